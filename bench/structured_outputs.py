"""Decode throughput with a JSON-schema constraint against the same decode without one, at batch
1 and 32, side by side in one run.

Workload: B requests with random 16-token prompts decode `steps` tokens each after their
prefill. Constrained requests carry a JSON schema (an array of a few hundred small objects:
integers with bounds, enums, short strings, booleans) long enough that no output completes within
the timed steps, so both sides time the same number of decode steps of the same batch; free
requests ignore EOS. Seeded sampling at temperature 1.0 on both sides.

Timing: each measurement adds B requests, steps until all have their first token, steps a few
more (warm-up), then times `steps` decode steps; requests are then aborted. Sides alternate for
`rounds` rounds and each keeps its fastest (a shared machine only ever slows a run down). The
grammar's mask is filled on the host after the forward pass is queued and applied on the device
before sampling (engine.structured.mask): on the CPU the two run one after the other, so the
ratio here is the whole cost of constraining.

Run: `python -m bench.structured_outputs [--quick] [--device cuda]`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import Figure, Result, RunSettings, now, run_benchmark
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.engine.structured import StructuredOutput

NAME = "structured_outputs"
GOAL = 0.9

ROW = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "tag": {"enum": ["alpha", "beta", "gamma"]},
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "name", "ok"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "items": ROW, "minItems": 400, "maxItems": 400}},
    "required": ["rows"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Workload:
    batches: tuple[int, ...]
    steps: int
    warmup_steps: int
    rounds: int
    prompt_len: int = 16
    seed: int = 0


WORKLOADS = {
    "full": Workload((1, 32), steps=64, warmup_steps=4, rounds=3),
    "quick": Workload((1, 32), steps=16, warmup_steps=2, rounds=4),
    "smoke": Workload((1, 4), steps=4, warmup_steps=1, rounds=1),
}


@dataclass(frozen=True)
class Timing:
    batch: int
    constrained: bool
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def time_decode(
    engine: LLMEngine, batch: int, constrained: bool, workload: Workload, rng: random.Random
) -> Timing:
    """`workload.steps` decode steps of `batch` requests (see the module docstring)."""
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None
    max_tokens = workload.steps + workload.warmup_steps + 8
    ids = [f"{'c' if constrained else 'f'}-{rng.getrandbits(40):x}-{i}" for i in range(batch)]
    vocab = engine.model_config.vocab_size
    for i, request_id in enumerate(ids):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=rng.getrandbits(32) + i,
            ignore_eos=not constrained,
            structured=structured,
        )
        prompt = [rng.randrange(3, vocab) for _ in range(workload.prompt_len)]
        engine.add_request(EngineRequest(request_id, params, prompt_token_ids=prompt))
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    for _ in range(workload.warmup_steps):
        engine.step()
    device = engine.config.device
    tokens = 0
    begin = now(device)
    for _ in range(workload.steps):
        outputs = engine.step()
        tokens += sum(len(o.token_ids) for o in outputs)
        assert not any(o.finished for o in outputs), "an output ended inside the timed steps"
    seconds = now(device) - begin
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
    return Timing(batch, constrained, seconds, tokens)


def measure(
    settings: RunSettings, model_dir: Path, workload: Workload
) -> tuple[EngineConfig, dict[tuple[int, bool], Timing], float]:
    config = EngineConfig(
        model=model_dir,
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=256,
        max_num_seqs=max(workload.batches),
        enable_lora=False,
    )
    engine = LLMEngine(config)
    rng = random.Random(workload.seed)
    started = time.perf_counter()
    time_decode(engine, 1, True, Workload((1,), 2, 1, 1), rng)  # compile and warm up once
    compile_s = time.perf_counter() - started
    best: dict[tuple[int, bool], Timing] = {}
    for _ in range(workload.rounds):
        for batch in workload.batches:
            for constrained in (False, True):
                t = time_decode(engine, batch, constrained, workload, rng)
                key = (batch, constrained)
                if key not in best or t.seconds < best[key].seconds:
                    best[key] = t
    return config, best, compile_s


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload = WORKLOADS[settings.mode]
    config, best, compile_s = measure(settings, model_dir, workload)
    figures: list[Figure] = []
    for batch in workload.batches:
        free, constrained = best[(batch, False)], best[(batch, True)]
        figures += [
            Figure(f"unconstrained tokens/s, batch {batch}", free.tokens_per_s, "tokens/s"),
            Figure(f"constrained tokens/s, batch {batch}", constrained.tokens_per_s, "tokens/s"),
            Figure(
                f"constrained / unconstrained, batch {batch}",
                constrained.tokens_per_s / free.tokens_per_s,
                "ratio",
                GOAL,
            ),
        ]
    engine_settings = asdict(config)
    del engine_settings["model"]
    workload_info = asdict(workload) | {
        "schema": SCHEMA,
        "sampling": "temperature 1.0, seeded; free requests ignore EOS",
        "library": "llguidance",
    }
    details = {
        "timings": [asdict(t) | {"tokens_per_s": t.tokens_per_s} for t in best.values()],
        "first_request_with_compile_s": compile_s,
    }
    return Result(NAME, settings, model, workload_info, engine_settings, figures, details)


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
