"""Decode-step measurements for the GPU suite (bench.gpu_suite): the engine's step time with B
requests decoding, and the bytes such a step must read at least.

A measurement adds B requests, steps until each has its first token and a few steps more, then
times a run of decode steps with the device synchronized only at both ends, so asynchronous
scheduling overlaps the host's work with the device's as it does in serving. Its requests are
then aborted and the engine drained.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from bench.common import now
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.model_runner import kv_bytes_per_block
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class DecodeTiming:
    batch: int
    step_ms: float
    """Mean wall time of one decode step over the timed run."""
    mean_context: float
    """KV positions a request attends over in a timed step, on average."""
    running: int
    """Requests the fewest-running timed step ran: always `batch` (`time_decode` raises
    otherwise: some waiting, for adapter memory say, would make it a smaller batch's timing)."""


def time_decode(
    engine: LLMEngine,
    adapters: Sequence[str | None],
    prompt_len: int,
    warmup_steps: int,
    steps: int,
    rng: random.Random,
    around: contextlib.AbstractContextManager[Any] | None = None,
) -> DecodeTiming:
    """Decode steps with len(adapters) running requests, request i on adapters[i] (None: the
    base model). Needs max_model_len >= prompt_len + steps the prefill takes + warmup + steps.
    `around` (a profiler, say) is entered for the timed steps alone."""
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    ids = [f"timed-{rng.getrandbits(48):x}-{i}" for i in range(len(adapters))]
    vocab = engine.model_config.vocab_size
    for request_id, adapter in zip(ids, adapters, strict=True):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(
            EngineRequest(request_id, params, prompt_token_ids=prompt, adapter=adapter)
        )
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step())
    for _ in range(warmup_steps):
        engine.step()
    contexts = [len(seq) for seq in engine.scheduler.running]
    device = engine.config.device
    running = len(ids)
    with around or contextlib.nullcontext():
        begin = now(device)
        for _ in range(steps):
            engine.step()
            running = min(running, len(engine.scheduler.running))
        seconds = now(device) - begin
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
    mean_context = sum(contexts) / len(contexts) + (steps - 1) / 2
    if running < len(ids):
        raise RuntimeError(
            f"a timed step ran {running} of {len(ids)} requests (the others waited, for adapter "
            "memory say): the timing would be of a smaller batch"
        )
    return DecodeTiming(len(ids), seconds / steps * 1e3, mean_context, running)


def step_bytes(engine: LLMEngine, timing: DecodeTiming) -> int:
    """Bytes a decode step must read at least: every weight but the embedding table (only the
    batch's rows of it), and the KV of every position each request attends over."""
    model = engine.model
    element = torch.empty((), dtype=engine.config.torch_dtype).element_size()
    weights = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters(remove_duplicate=False)
        if name != "embed_tokens.weight"
    )
    embedding_rows = timing.batch * model.config.hidden_size * element
    per_token = kv_bytes_per_block(model.config, 1, engine.config.torch_dtype)
    return int(weights + embedding_rows + timing.batch * timing.mean_context * per_token)


def copy_bandwidth(nbytes: int, device: str, iters: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin = now(device)
    for _ in range(iters):
        dst.copy_(src)
    seconds = now(device) - begin
    del src, dst
    return 2 * nbytes * iters / seconds


def with_engine(config: EngineConfig, measure: Callable[[LLMEngine], T]) -> T:
    """`measure` on a fresh engine, whose memory is handed back before this returns (the next
    engine of a suite needs the room)."""
    engine = LLMEngine(config)
    try:
        return measure(engine)
    finally:
        if engine.lora is not None:
            engine.lora.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
