"""n = 4 choices in one request against the same four choices as four separate requests.

Both cases submit at once and run to completion on an engine with prefix caching off, so the
separate requests cannot borrow each other's prompt blocks (four requests admitted in the same
step all miss the cache anyway: nothing is sealed before their prefill runs). The n = 4 request
prefills its prompt once and forks the choices on its KV blocks (copy-on-write of the partial
last block); the separate requests carry the choices' seeds (`choice_seed`), so both cases
generate the same tokens. Figures: prefill tokens computed (deltas of
`EngineStats.prompt_tokens_computed`, goal: the separate requests compute 4 × what n = 4 does)
and wall time to the last token (medians over repetitions after one untimed warm-up), with
their ratios separate / n=4; the ratios are also printed as one JSON line.

Run: `python -m bench.n_choices [--quick] [--device cuda --model-size 1b]`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Figure, Result, RunSettings, Stopwatch, median, run_benchmark
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams, choice_seed

NAME = "n_choices"
CHOICES = 4
CASES = ("n4", "separate")


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    output_tokens: int
    repetitions: int
    seed: int = 0


WORKLOADS = {
    "full": Workload(prompt_len=1024, output_tokens=32, repetitions=5),
    "quick": Workload(prompt_len=512, output_tokens=16, repetitions=3),
    "smoke": Workload(prompt_len=40, output_tokens=4, repetitions=1),
}


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float
    prompt_tokens_computed: int
    peak_kv_blocks: int
    tokens: list[list[int]]
    """Each choice's tokens, by index."""


def engine_config(settings: RunSettings, model_dir: Path, workload: Workload) -> EngineConfig:
    return EngineConfig(
        model=model_dir,
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=workload.prompt_len + workload.output_tokens,
        max_num_batched_tokens=CHOICES * workload.prompt_len,
        enable_prefix_caching=False,
    )


def requests(case: str, prompt: list[int], workload: Workload, seed: int) -> list[EngineRequest]:
    def params(n: int, choice: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=workload.output_tokens,
            temperature=1.0,
            seed=choice_seed(seed, choice),
            ignore_eos=True,
            n=n,
        )

    if case == "n4":
        return [EngineRequest(f"n4-{seed}", params(CHOICES, 0), prompt_token_ids=prompt)]
    return [
        EngineRequest(f"sep-{seed}-{i}", params(1, i), prompt_token_ids=prompt)
        for i in range(CHOICES)
    ]


def run(engine: LLMEngine, batch: list[EngineRequest], device: str) -> Run:
    before = engine.stats().prompt_tokens_computed
    tokens: dict[tuple[str, int], list[int]] = {}
    peak = 0
    with Stopwatch(device) as watch:
        for request in batch:
            engine.add_request(request)
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
            peak = max(peak, engine.stats().kv_blocks_used)
    computed = engine.stats().prompt_tokens_computed - before
    ordered = [tokens[key] for key in sorted(tokens)]
    return Run(watch.seconds, watch.cpu_seconds, computed, peak, ordered)


def measure(settings: RunSettings, model_dir: Path, workload: Workload) -> list[dict[str, Run]]:
    engine = LLMEngine(engine_config(settings, model_dir, workload))
    rng = random.Random(workload.seed)
    reps = []
    for rep in range(workload.repetitions + 1):  # the first one warms up, untimed
        prompt = [rng.randrange(3, 4000) for _ in range(workload.prompt_len)]
        runs = {
            case: run(engine, requests(case, prompt, workload, rep), settings.device)
            for case in CASES
        }
        if rep:
            reps.append(runs)
    return reps


def summarize(
    settings: RunSettings, model: dict[str, Any], workload: Workload, reps: list[dict[str, Run]]
) -> Result:
    seconds = {c: median([r[c].seconds for r in reps]) for c in CASES}
    computed = {c: median([r[c].prompt_tokens_computed for r in reps]) for c in CASES}
    blocks = {c: median([r[c].peak_kv_blocks for r in reps]) for c in CASES}
    ratios = {
        "prefill_tokens_separate_over_n4": computed["separate"] / computed["n4"],
        "wall_time_separate_over_n4": seconds["separate"] / seconds["n4"],
        "peak_kv_blocks_separate_over_n4": blocks["separate"] / blocks["n4"],
    }
    print(json.dumps(ratios))
    figures = [
        Figure("prefill tokens computed, n=4", computed["n4"], "tokens"),
        Figure("prefill tokens computed, 4 requests", computed["separate"], "tokens"),
        Figure(
            "prefill tokens ratio 4 requests / n=4",
            ratios["prefill_tokens_separate_over_n4"],
            "x",
            float(CHOICES),
        ),
        Figure("wall time n=4, median", seconds["n4"] * 1e3, "ms"),
        Figure("wall time 4 requests, median", seconds["separate"] * 1e3, "ms"),
        Figure("wall time ratio 4 requests / n=4", ratios["wall_time_separate_over_n4"], "x"),
        Figure(
            "peak KV blocks ratio 4 requests / n=4", ratios["peak_kv_blocks_separate_over_n4"], "x"
        ),
    ]
    details = {
        "ratios": ratios,
        "same_tokens_every_repetition": all(r["n4"].tokens == r["separate"].tokens for r in reps),
        "wall_time_ratio_by_cpu_time": median([r["separate"].cpu_seconds for r in reps])
        / median([r["n4"].cpu_seconds for r in reps]),
        "repetitions": [
            {c: dataclasses.asdict(r[c]) | {"tokens": None} for c in CASES} for r in reps
        ],
    }
    config = dataclasses.asdict(engine_config(settings, Path(), workload))
    del config["model"]
    return Result(NAME, settings, model, dataclasses.asdict(workload), config, figures, details)


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload = WORKLOADS[settings.mode]
    return summarize(settings, model, workload, measure(settings, model_dir, workload))


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
