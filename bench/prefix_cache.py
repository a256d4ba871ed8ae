"""Time to first token of a prompt whose first blocks are in the prefix cache, against the same
prompt computed cold.

Each repetition draws a fresh shared prefix P (so repetitions never help each other) and two
different tails T1, T2; prompt lengths are |P| + |T|. Per repetition, in this order:
- cold: P+T2 on an engine with prefix caching disabled (every prompt token is computed);
- miss: P+T1 on the caching engine, where nothing matches (cold plus hashing cost); it runs to
  completion, which leaves P's blocks in the cache;
- warm: P+T2 on the caching engine, which finds P cached and computes only T2.
Time to first token is measured from `add_request` to the `step()` that returns the request's
first token; the rest of its output is generated untimed. The figures are medians over the
repetitions (after one untimed warm-up repetition) and their ratio, with the prefill tokens each
case computed (deltas of `EngineStats.prompt_tokens_computed`); details add the ratio of median
CPU times and of the fastest repetitions, which a shared machine's load disturbs less.

Run: `python -m bench.prefix_cache [--quick] [--device cuda --model-size 1b]`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.common import Figure, Result, RunSettings, Stopwatch, median, run_benchmark
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EngineRequest
from engine.sampling import SamplingParams

NAME = "prefix_cache"
CASES = ("cold", "miss", "warm")


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    shared_len: int
    """Leading prompt tokens shared with the request that ran before."""
    output_tokens: int
    repetitions: int
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.output_tokens


WORKLOADS = {
    "full": Workload(1024, 960, 8, 20),
    "quick": Workload(1024, 960, 8, 6),
    "smoke": Workload(64, 48, 2, 1),
}


@dataclass(frozen=True)
class FirstToken:
    seconds: float
    cpu_seconds: float
    """Process CPU time over the same span: on a shared machine it grows less with others' load."""
    prompt_tokens_computed: int
    cached_tokens: int
    """Prompt tokens the engine reports as served from the prefix cache (from usage)."""


def engine_config(
    settings: RunSettings, model_dir: Path, workload: Workload, caching: bool
) -> EngineConfig:
    """One step can prefill the whole prompt, so the cold case is not split into chunks."""
    return EngineConfig(
        model=model_dir,
        dtype=settings.dtype,
        device=settings.device,
        max_model_len=workload.max_model_len,
        max_num_batched_tokens=max(512, workload.prompt_len),
        enable_prefix_caching=caching,
    )


def first_token(
    engine: LLMEngine, request_id: str, prompt: list[int], workload: Workload, device: str
) -> FirstToken:
    """Time from submission to the request's first token; then finish the request untimed."""
    before = engine.stats().prompt_tokens_computed
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    with Stopwatch(device) as watch:
        engine.add_request(EngineRequest(request_id, params, prompt_token_ids=prompt))
        outputs = engine.step()
        while not any(o.request_id == request_id and o.token_ids for o in outputs):
            outputs = engine.step()
    computed = engine.stats().prompt_tokens_computed - before
    while engine.has_work:
        outputs += engine.step()
    usage = next(o.usage for o in outputs if o.request_id == request_id and o.usage)
    return FirstToken(watch.seconds, watch.cpu_seconds, computed, usage.cached_tokens)


def repetition(
    engines: dict[str, LLMEngine],
    vocab: Sequence[int],
    rng: random.Random,
    tag: str,
    workload: Workload,
    device: str,
) -> dict[str, FirstToken]:
    """One cold / miss / warm round on a fresh shared prefix."""
    tail = workload.prompt_len - workload.shared_len
    prefix = [rng.choice(vocab) for _ in range(workload.shared_len)]
    first = prefix + [rng.choice(vocab) for _ in range(tail)]
    second = prefix + [rng.choice(vocab) for _ in range(tail)]
    return {
        "cold": first_token(engines["cold"], f"{tag}-cold", second, workload, device),
        "miss": first_token(engines["caching"], f"{tag}-miss", first, workload, device),
        "warm": first_token(engines["caching"], f"{tag}-warm", second, workload, device),
    }


def measure(
    settings: RunSettings, model_dir: Path, workload: Workload
) -> list[dict[str, FirstToken]]:
    """Every timed repetition, after one untimed warm-up round."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    engines = {
        "cold": LLMEngine(engine_config(settings, model_dir, workload, caching=False)),
        "caching": LLMEngine(engine_config(settings, model_dir, workload, caching=True)),
    }
    rng = random.Random(workload.seed)
    repetition(engines, vocab, rng, "warm-up", workload, settings.device)
    return [
        repetition(engines, vocab, rng, f"rep-{i}", workload, settings.device)
        for i in range(workload.repetitions)
    ]


def summarize(
    settings: RunSettings,
    model: dict[str, Any],
    workload: Workload,
    reps: list[dict[str, FirstToken]],
) -> Result:
    ttft = {case: median([r[case].seconds for r in reps]) for case in CASES}
    computed = {case: median([r[case].prompt_tokens_computed for r in reps]) for case in CASES}
    figures = [
        Figure("TTFT cold (prefix caching off), median", ttft["cold"] * 1e3, "ms"),
        Figure("TTFT cached prefix, median", ttft["warm"] * 1e3, "ms"),
        Figure("TTFT speedup cold / cached", ttft["cold"] / ttft["warm"], "x", 5.0),
        Figure("TTFT cache miss (caching on), median", ttft["miss"] * 1e3, "ms"),
        Figure("prefill tokens computed, cold", computed["cold"], "tokens"),
        Figure("prefill tokens computed, cached", computed["warm"], "tokens"),
    ]
    cpu = {case: median([r[case].cpu_seconds for r in reps]) for case in CASES}
    details = {
        "speedup_by_cpu_time": cpu["cold"] / cpu["warm"],
        "speedup_best_of_repetitions": min(r["cold"].seconds for r in reps)
        / min(r["warm"].seconds for r in reps),
        "repetitions": [{case: dataclasses.asdict(r[case]) for case in CASES} for r in reps],
        "cases": {
            "cold": "prefix caching disabled; the same prompt as warm",
            "miss": "caching engine, nothing cached; seeds the shared prefix",
            "warm": "caching engine, the shared prefix cached by the miss request",
        },
    }
    workload_info = dataclasses.asdict(workload) | {
        "max_model_len": workload.max_model_len,
        "prompt_tokens_from": "uniform over the tokenizer's non-special vocabulary",
    }
    config = dataclasses.asdict(engine_config(settings, Path(), workload, caching=True))
    del config["model"], config["enable_prefix_caching"]  # per case, see details.cases
    return Result(NAME, settings, model, workload_info, config, figures, details)


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload = WORKLOADS[settings.mode]
    return summarize(settings, model, workload, measure(settings, model_dir, workload))


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
