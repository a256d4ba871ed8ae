"""Requests spread over adapters, and running them on the engine, all at once or arriving over
time: what the LoRA batching benchmark (bench.lora_batching) and its PEFT reference
(bench.peft_reference) share."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import now
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt: list[int]
    adapter: int | None
    """Index into the adapter folders; None for the base model."""
    arrival: float = 0.0
    """Only for arrivals over time (bench.lora_batching, part c): seconds after the stream
    starts."""


Run = tuple[float, list[list[int]]]
"""Seconds taken, and each request's output tokens in request order."""


def plain_vocab(tokenizer: Any) -> list[int]:
    """Every token id that is not a special token."""
    return [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]


def make_prompts(
    lengths: tuple[int, int], vocab: Sequence[int], rng: random.Random, n: int
) -> list[list[int]]:
    """`n` prompts of lengths uniform in `lengths`, tokens uniform over `vocab`."""
    return [[rng.choice(vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def spread(prompts: Sequence[list[int]], distinct: int | None, tag: str) -> list[Request]:
    """Request i on adapter i % distinct (None: every request on the base model)."""
    return [
        Request(f"{tag}-{i}", p, None if distinct is None else i % distinct)
        for i, p in enumerate(prompts)
    ]


# -- on the engine -----------------------------------------------------------------------------------
def engine_request(r: Request, digests: Sequence[str], out_len: int) -> EngineRequest:
    params = SamplingParams(max_tokens=out_len, ignore_eos=True)
    adapter = None if r.adapter is None else digests[r.adapter]
    return EngineRequest(r.request_id, params, prompt_token_ids=r.prompt, adapter=adapter)


def run_engine(
    engine: LLMEngine, requests: Sequence[Request], digests: Sequence[str], out_len: int
) -> Run:
    """Submit every request at once and step until idle."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    device = engine.config.device
    start = now(device)
    for r in requests:
        engine.add_request(engine_request(r, digests, out_len))
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    return now(device) - start, [outputs[r.request_id] for r in requests]


def warm_slots(engine: LLMEngine, digests: Sequence[str]) -> None:
    """One two-token request per adapter: with enough slots, every adapter is then in one."""
    warm = [Request(f"warm-{i}", [10 + i % 50] * 4, i) for i in range(len(digests))]
    run_engine(engine, warm, digests, 2)


def register(engine: LLMEngine, folders: Sequence[Path]) -> list[str]:
    return [engine.register_adapter(f) for f in folders]


# -- arrivals over time ----------------------------------------------------------------------
@dataclass(frozen=True)
class StreamRun:
    ttft: list[float]
    """Seconds from arrival to first token, per request in arrival order."""
    added_ttft: list[float]
    """Seconds from `add_request` (the step boundary after the arrival) to first token."""
    seconds: float
    busy_seconds: float
    """Time inside steps that computed tokens."""
    drain_seconds: float
    """From the last arrival until idle: far above one request's own time, the engine fell
    behind the arrivals and TTFT measures its queue."""
    slot_loads: int
    host_loads: int
    """Adapters read from disk during the stream (registration not counted)."""


def run_stream(
    engine: LLMEngine, stream: Sequence[Request], digests: Sequence[str], out_len: int
) -> StreamRun:
    """Replay the arrivals in real time on this thread: before each step, add every request
    whose arrival time has come. Sleeps until the next arrival when idle, and 1 ms after a step
    that computed nothing (its requests wait for adapters read on the loader thread)."""
    device = engine.config.device
    before = adapter_loads(engine)
    pending = deque(stream)
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    busy = 0.0
    start = now(device)
    while pending or engine.has_work:
        clock = now(device) - start
        while pending and pending[0].arrival <= clock:
            r = pending.popleft()
            engine.add_request(engine_request(r, digests, out_len))
            added[r.request_id] = clock
        if not engine.has_work:
            time.sleep(max(0.0, pending[0].arrival - clock))
            continue
        steps = engine.stats().steps
        outputs = engine.step()
        done = now(device) - start
        if engine.stats().steps == steps:
            time.sleep(1e-3)
            continue
        busy += done - clock
        for out in outputs:
            first.setdefault(out.request_id, done)
    seconds = now(device) - start
    after = adapter_loads(engine)
    return StreamRun(
        [first[r.request_id] - r.arrival for r in stream],
        [first[r.request_id] - added[r.request_id] for r in stream],
        seconds,
        busy,
        seconds - stream[-1].arrival,
        after[0] - before[0],
        after[1] - before[1],
    )


def adapter_loads(engine: LLMEngine) -> tuple[int, int]:
    """(device-slot loads, host-tier loads) summed over every adapter so far."""
    stats = engine.adapter_stats().values()
    return sum(s.slot_loads for s in stats), sum(s.loads for s in stats)
