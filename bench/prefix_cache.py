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

Tenant scoping: the cost of `EngineRequest.cache_salt` (one prefix-cache namespace per tenant)
where tenants share no prompts. Each tenant has its own system prefix, reused by its own
requests only: its first request runs, then the rest together, which find that prefix cached.
The same prompts run with no salt and with the tenant's id as salt, on the caching engine, in
alternating order; each repetition draws fresh prompts. The figure is the throughput ratio
salted / unsalted (tokens of prompt and output per wall second; medians over repetitions);
details hold the prefill tokens each case computed, which must be equal.

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
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams

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
class TenantWorkload:
    tenants: int
    requests_per_tenant: int
    prefix_len: int
    """Each tenant's own system prefix, shared by its requests and no one else's."""
    tail_len: int
    output_tokens: int
    repetitions: int

    @property
    def tokens(self) -> int:
        """Prompt and output tokens of one run (the throughput numerator)."""
        per_request = self.prefix_len + self.tail_len + self.output_tokens
        return self.tenants * self.requests_per_tenant * per_request


TENANT_WORKLOADS = {
    "full": TenantWorkload(8, 4, 512, 64, 16, 5),
    "quick": TenantWorkload(4, 3, 256, 32, 4, 7),
    "smoke": TenantWorkload(2, 2, 32, 8, 2, 1),
}
SCOPES = ("unsalted", "salted")


@dataclass(frozen=True)
class TenantRun:
    seconds: float
    cpu_seconds: float
    prompt_tokens_computed: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache, summed over the run's requests (usage)."""


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
    return settings.engine(
        max_model_len=workload.max_model_len,
        max_num_batched_tokens=max(512, workload.prompt_len),
        prefix_caching=caching,
    ).engine_config(model_dir)


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
    settings: RunSettings, model_dir: Path, workload: Workload, tenants: TenantWorkload
) -> tuple[list[dict[str, FirstToken]], list[dict[str, TenantRun]]]:
    """Every timed repetition of both comparisons, each after one untimed warm-up round."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    engines = {
        "cold": LLMEngine(engine_config(settings, model_dir, workload, caching=False)),
        "caching": LLMEngine(engine_config(settings, model_dir, workload, caching=True)),
    }
    rng = random.Random(workload.seed)
    repetition(engines, vocab, rng, "warm-up", workload, settings.device)
    reps = [
        repetition(engines, vocab, rng, f"rep-{i}", workload, settings.device)
        for i in range(workload.repetitions)
    ]
    return reps, measure_tenants(settings, engines["caching"], vocab, tenants)


def tenant_run(
    engine: LLMEngine,
    prompts: dict[str, list[list[int]]],
    salted: bool,
    tag: str,
    workload: TenantWorkload,
    device: str,
) -> TenantRun:
    """Every tenant's first request, then the rest of each tenant's; timed until all finish."""
    params = SamplingParams(max_tokens=workload.output_tokens, ignore_eos=True)
    before = engine.stats().prompt_tokens_computed
    cached = 0
    with Stopwatch(device) as watch:
        for wave in (slice(0, 1), slice(1, None)):
            for tenant, requests in prompts.items():
                for i, prompt in enumerate(requests[wave], start=wave.start):
                    engine.add_request(
                        EngineRequest(
                            f"{tag}-{tenant}-{i}",
                            params,
                            prompt_token_ids=prompt,
                            cache_salt=tenant if salted else None,
                        )
                    )
            while engine.has_work:
                cached += sum(o.usage.cached_tokens for o in engine.step() if o.usage)
    computed = engine.stats().prompt_tokens_computed - before
    return TenantRun(watch.seconds, watch.cpu_seconds, computed, cached)


def tenant_repetition(
    engine: LLMEngine,
    vocab: Sequence[int],
    rng: random.Random,
    tag: str,
    workload: TenantWorkload,
    device: str,
    salted_first: bool,
) -> dict[str, TenantRun]:
    """One unsalted and one salted run of the same fresh prompts (neither can reuse the other's
    blocks: the salt changes every block's hash)."""

    def draw(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    prompts = {}
    for t in range(workload.tenants):
        prefix = draw(workload.prefix_len)
        prompts[f"tenant-{t}"] = [
            prefix + draw(workload.tail_len) for _ in range(workload.requests_per_tenant)
        ]
    order = SCOPES[::-1] if salted_first else SCOPES
    return {
        scope: tenant_run(engine, prompts, scope == "salted", f"{tag}-{scope}", workload, device)
        for scope in order
    }


def measure_tenants(
    settings: RunSettings, engine: LLMEngine, vocab: Sequence[int], workload: TenantWorkload
) -> list[dict[str, TenantRun]]:
    rng = random.Random(1)
    tenant_repetition(engine, vocab, rng, "tenants-warm-up", workload, settings.device, False)
    return [
        tenant_repetition(engine, vocab, rng, f"tenants-{i}", workload, settings.device, i % 2 == 1)
        for i in range(workload.repetitions)
    ]


def tenant_figures(
    workload: TenantWorkload, runs: list[dict[str, TenantRun]]
) -> tuple[list[Figure], dict[str, Any]]:
    seconds = {scope: median([r[scope].seconds for r in runs]) for scope in SCOPES}
    cpu = {scope: median([r[scope].cpu_seconds for r in runs]) for scope in SCOPES}
    figures = [
        Figure("throughput, no cache salt", workload.tokens / seconds["unsalted"], "tokens/s"),
        Figure("throughput, per-tenant salt", workload.tokens / seconds["salted"], "tokens/s"),
        Figure(
            "throughput ratio per-tenant salt / none", seconds["unsalted"] / seconds["salted"], "x"
        ),
    ]
    details = {
        "ratio_by_cpu_time": cpu["unsalted"] / cpu["salted"],
        "ratio_best_of_repetitions": min(r["unsalted"].seconds for r in runs)
        / min(r["salted"].seconds for r in runs),
        "runs": [{scope: dataclasses.asdict(r[scope]) for scope in SCOPES} for r in runs],
    }
    return figures, details


def summarize(
    settings: RunSettings,
    model: dict[str, Any],
    workload: Workload,
    reps: list[dict[str, FirstToken]],
    tenants: TenantWorkload,
    tenant_runs: list[dict[str, TenantRun]],
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
    scoped_figures, details["tenant_scoping"] = tenant_figures(tenants, tenant_runs)
    figures += scoped_figures
    workload_info = dataclasses.asdict(workload) | {
        "max_model_len": workload.max_model_len,
        "prompt_tokens_from": "uniform over the tokenizer's non-special vocabulary",
        "tenant_scoping": dataclasses.asdict(tenants) | {"tokens_per_run": tenants.tokens},
    }
    config = dataclasses.asdict(engine_config(settings, Path(), workload, caching=True))
    del config["model"], config["enable_prefix_caching"]  # per case, see details.cases
    return Result(NAME, settings, model, workload_info, config, figures, details)


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload, tenants = WORKLOADS[settings.mode], TENANT_WORKLOADS[settings.mode]
    reps, tenant_runs = measure(settings, model_dir, workload, tenants)
    return summarize(settings, model, workload, reps, tenants, tenant_runs)


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
