"""Many adapters in one batch: the engine against PEFT, throughput as the number of distinct
adapters grows, and time to first token when many adapters share few device slots.

Requests: prompt lengths uniform in a range, prompt tokens uniform over the tokenizer's
non-special vocabulary, exactly `output_len` new tokens each (EOS ignored), so no side wastes
work on uneven lengths. Adapters are genuine PEFT demo adapters (five target sets, ranks cycling
through the workload's `ranks`); the result's `workload.adapter_flops_share` is their LoRA FLOPs
per token against the base model's (bench.models: linear layers only, attention scores excluded).

Model sizes (`--model-size`): `demo` (default; its figures are regression figures: ranks 8-64 on a
4.9M-parameter model are up to 30% of its FLOPs, so they measure adapter weights) and
`realistic` (bench.models: hidden 1024 on CPU, Llama-3-8B's shapes on CUDA) with ranks whose
LoRA FLOPs are ~0.5-5% of the model's, median ~1.5% on CPU; its results are
`lora_batching-realistic[-quick].json`. Issue 14's goals are measured on `realistic`. Its quick
run registers 128 adapters in (c) (the full one 500), and on CUDA at most CUDA_MAX_ADAPTERS.

a. N requests, request i on adapter i: the engine (all submitted at once, step until idle);
   PEFT mixed-adapter batches (`generate(adapter_names=...)`, static batches of B in submission
   order, left-padded); PEFT one adapter at a time (`set_adapter`, then one `generate` of that
   adapter's requests). Output tokens/s of each; goal: the engine >= 5x the better PEFT way
   (30x on CUDA at the realistic size).
   Every adapter is loaded on both sides before timing: the engine's adapter memory holds N
   adapters of the maximum rank, so all N are resident (`slot_loads` in `details` counts the
   copies into device memory while timed: 0).
b. The same N requests spread round-robin over 1, 8, ... N adapters (and on the base model, for
   context); goal: N adapters keep >= 0.85 of the single adapter's throughput (0.9 at the
   realistic size).
c. M adapters with Zipf(s) popularity; requests arrive as a Poisson process at `load` times the
   request rate the engine sustained in (b) with N adapters (median repetition), and are added
   before each step once their arrival time has come. Time to first token (TTFT) = arrival
   time to the return of the step that produced the request's first token. Once with the
   adapter memory of `slots` full-rank adapters (as many adapters resident as fit at their own
   ranks; `host` adapters in host memory), once with every adapter resident; each engine first
   runs an untimed burst drawn from the same popularity (the all-resident one also one request
   per adapter, so that every adapter is resident). Goal: median TTFT in the small memory at
   most 2x the all-resident one, reported as all-resident / small memory >= 0.5. The
   engines must keep up with the arrivals for TTFT to mean anything: see
   `StreamRun.drain_seconds` (bench.adapter_requests).
d. DoRA against plain LoRA: the N requests of (a) on N DoRA adapters (the same configs and
   pairs as (a)'s adapters, plus magnitude vectors: build_demo_adapters(dora=True)) and on the N
   plain ones, both sets resident in one engine, repetitions interleaved; goal: DoRA keeps
   >= 0.9 of plain LoRA's throughput.
Correctness: the engine's outputs in (a) equal PEFT's one-adapter-at-a-time greedy outputs token
for token (`generate(eos_token_id=None)` disables EOS; output lengths are asserted).
Timing: each engine case and each PEFT way runs `repeats` times, interleaved; the fastest
counts (on a shared machine, the least disturbed run); all are in `details`.

Run: `python -m bench.lora_batching [--quick] [--threads 1] [--model-size realistic]`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.adapter_requests import (
    Request,
    Run,
    StreamRun,
    adapter_loads,
    make_prompts,
    plain_vocab,
    register,
    run_engine,
    run_stream,
    spread,
    warm_slots,
)
from bench.common import (
    Figure,
    Result,
    RunSettings,
    median,
    percentile,
    prepared_run,
    report,
)
from bench.models import demo_adapters_flops_share
from bench.peft_reference import Peft, load_peft
from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.demo import DEMO_RANKS, build_demo_adapters
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.lora.memory import full_rank_bytes

NAME = "lora_batching"


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]
    output_len: int
    distinct: tuple[int, ...]
    """(b): adapter counts; the last is num_requests, the case (a) compares with PEFT."""
    peft_batch_sizes: tuple[int, ...]
    repeats: int
    num_adapters: int
    """(c): registered adapters; adapter k has popularity weight 1 / (k + 1) ** zipf_s."""
    slots: int
    host: int
    stream: int
    """(c): timed requests per engine."""
    burst: int
    """(c): untimed requests run first, from the same popularity."""
    zipf_s: float = 1.1
    load: float = 0.5
    seed: int = 0
    ranks: tuple[int, ...] = DEMO_RANKS
    """Adapter i has rank ranks[i % len(ranks)]; the engine's max_lora_rank is the largest."""
    speedup_goal: float = 5.0
    """(a): the engine's throughput against the better PEFT way."""
    spread_goal: float = 0.85
    """(b): N adapters' throughput against one adapter's."""

    @property
    def max_model_len(self) -> int:
        return self.prompt_lens[1] + self.output_len


WORKLOADS = {
    "full": Workload(64, (16, 64), 32, (1, 8, 64), (16, 64), 3, 500, 16, 64, 400, 200),
    "quick": Workload(16, (16, 48), 16, (1, 4, 16), (16,), 1, 64, 8, 16, 48, 24),
    "smoke": Workload(4, (8, 16), 4, (1, 4), (4,), 1, 8, 2, 4, 8, 4),
}
REALISTIC_RANKS = (16, 32)
"""On the CPU realistic model: 0.4-4.7% of its FLOPs per adapter (median 1.5%)."""
REALISTIC_WORKLOADS = {
    mode: dataclasses.replace(w, ranks=REALISTIC_RANKS, spread_goal=0.9)
    for mode, w in WORKLOADS.items()
}
REALISTIC_WORKLOADS["quick"] = dataclasses.replace(
    REALISTIC_WORKLOADS["quick"], num_adapters=128, repeats=2
)
"""Quick: 128 adapters in (c), not 500 (the full run's); two repetitions, as one is easily
disturbed on a shared machine."""
CUDA_REALISTIC_RANKS = (32, 64)
"""On Llama-3-8B's shapes: 0.2-2.2% of its FLOPs per adapter (median 0.7%). An adapter is then
~0.2 GB in float32, so (c) registers at most CUDA_MAX_ADAPTERS of them (disk and build time)."""
CUDA_MAX_ADAPTERS = 100


def choose_workload(settings: RunSettings) -> Workload:
    """The workload of this run's mode at its model size (see the module docstring)."""
    if settings.model_size != "realistic":
        return WORKLOADS[settings.mode]
    w = REALISTIC_WORKLOADS[settings.mode]
    if not settings.is_cuda:
        return w
    count = min(w.num_adapters, CUDA_MAX_ADAPTERS)
    return dataclasses.replace(
        w,
        ranks=CUDA_REALISTIC_RANKS,
        speedup_goal=30.0,
        num_adapters=count,
        host=min(w.host, count),
    )


def engine_config(
    settings: RunSettings,
    model_dir: Path,
    w: Workload,
    slots: int,
    host: int,
    memory_adapters: int | None = None,
) -> EngineConfig:
    """Prefix caching off: every case reruns the same prompts, and must compute them again.
    `memory_adapters`: adapter memory for that many adapters of the maximum rank on every
    projection (how many real adapters fit follows their ranks); None: one per slot."""
    config = settings.engine(
        max_model_len=w.max_model_len,
        max_num_seqs=64,
        max_loras=slots,
        max_cpu_loras=host,
        max_lora_rank=max(w.ranks),
        prefix_caching=False,
    ).engine_config(model_dir)
    if memory_adapters is None:
        return config
    base = BaseModelSpec.from_model_dir(model_dir)
    memory = full_rank_bytes(base, memory_adapters, config.max_lora_rank, config.torch_dtype)
    return dataclasses.replace(config, lora_memory_bytes=memory)


# -- (a) and (b) ------------------------------------------------------------------------------
@dataclass
class Timed:
    """One case: the seconds of every repetition, the last repetition's outputs and, for the
    engine, the adapters it had to copy into device memory while timed (0: all resident)."""

    tokens: int
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    slot_loads: list[int] = field(default_factory=list)

    def add(self, run: Run, slot_loads: int = 0) -> None:
        self.seconds.append(run[0])
        self.outputs = run[1]
        self.slot_loads.append(slot_loads)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / min(self.seconds)


def engine_case(distinct: int | None) -> str:
    """The name of an engine case in `details.cases` and the figures."""
    if distinct is None:
        return "engine, base model"
    return f"engine, {distinct} adapter{'s' if distinct > 1 else ''}"


def measure_batching(
    settings: RunSettings, model_dir: Path, folders: Sequence[Path], w: Workload
) -> dict[str, Timed]:
    """Every case of (a) and (b), keyed 'engine, base model', 'engine, <d> adapters' for d in
    w.distinct, 'peft-mixed-<B>' for B in w.peft_batch_sizes and 'peft-one'."""
    n = w.distinct[-1]
    engine = LLMEngine(engine_config(settings, model_dir, w, slots=n, host=n, memory_adapters=n))
    prompts = make_prompts(
        w.prompt_lens, plain_vocab(engine.tokenizer), random.Random(w.seed), w.num_requests
    )
    digests = register(engine, folders[:n])
    warm_slots(engine, digests)
    dtype = engine.config.torch_dtype
    peft = Peft(
        load_peft(model_dir, folders[:n], dtype, settings.device),
        [f.name for f in folders[:n]],
        w.output_len,
        engine.tokenizer.pad_token_id,
    )
    peft.generate([prompts[0], prompts[1][:8]], peft.names[:2])  # warm-up
    every = spread(prompts, n, "peft")
    timed: defaultdict[str, Timed] = defaultdict(lambda: Timed(len(prompts) * w.output_len))
    for rep in range(w.repeats):
        for d in (None, *w.distinct):
            loads = adapter_loads(engine)[0]
            run = run_engine(engine, spread(prompts, d, f"{rep}-{d}"), digests, w.output_len)
            timed[engine_case(d)].add(run, adapter_loads(engine)[0] - loads)
        for b in w.peft_batch_sizes:
            timed[f"peft-mixed-{b}"].add(peft.run_mixed(every, b))
        timed["peft-one"].add(peft.run_per_adapter(every))
    return dict(timed)


def measure_dora(
    settings: RunSettings, model_dir: Path, plain: Sequence[Path], dora: Sequence[Path], w: Workload
) -> dict[str, Timed]:
    """(d): 'plain' and 'dora', the N requests of (a) on N adapters of each kind, every adapter
    resident (both sets in one engine's memory)."""
    n = len(plain)
    engine = LLMEngine(engine_config(settings, model_dir, w, 2 * n, 2 * n, memory_adapters=2 * n))
    prompts = make_prompts(
        w.prompt_lens, plain_vocab(engine.tokenizer), random.Random(w.seed), w.num_requests
    )
    digests = {"plain": register(engine, plain), "dora": register(engine, dora)}
    for kind_digests in digests.values():
        warm_slots(engine, kind_digests)
    timed: defaultdict[str, Timed] = defaultdict(lambda: Timed(len(prompts) * w.output_len))
    for rep in range(w.repeats):
        for kind, kind_digests in digests.items():
            loads = adapter_loads(engine)[0]
            run = run_engine(
                engine, spread(prompts, n, f"{kind}-{rep}"), kind_digests, w.output_len
            )
            timed[kind].add(run, adapter_loads(engine)[0] - loads)
    return dict(timed)


# -- (c) --------------------------------------------------------------------------------------
def zipf_requests(
    w: Workload, vocab: Sequence[int], rng: random.Random, n: int, rate: float, tag: str
) -> list[Request]:
    """`n` requests on Zipf-popular adapters with Poisson arrivals at `rate` per second."""
    weights = [1 / (k + 1) ** w.zipf_s for k in range(w.num_adapters)]
    adapters = rng.choices(range(w.num_adapters), weights, k=n)
    arrivals = itertools.accumulate(rng.expovariate(rate) for _ in range(n))
    prompts = make_prompts(w.prompt_lens, vocab, rng, n)
    return [
        Request(f"{tag}-{i}", p, a, t)
        for i, (p, a, t) in enumerate(zip(prompts, adapters, arrivals, strict=True))
    ]


def measure_many_adapters(
    settings: RunSettings, model_dir: Path, folders: Sequence[Path], w: Workload, rate: float
) -> dict[str, StreamRun]:
    """The same burst and stream through the adapter memory of `w.slots` full-rank adapters
    ('few': every adapter may be resident, as many as fit at their ranks) and with every
    adapter resident ('resident'), one engine at a time."""
    m = w.num_adapters
    vocab = plain_vocab(AutoTokenizer.from_pretrained(str(model_dir)))
    rng = random.Random(w.seed + 1)
    burst = zipf_requests(w, vocab, rng, w.burst, rate, "burst")
    stream = zipf_requests(w, vocab, rng, w.stream, rate, "stream")
    runs: dict[str, StreamRun] = {}
    for case, memory, host in (("few", w.slots, w.host), ("resident", m, m)):
        engine = LLMEngine(engine_config(settings, model_dir, w, m, host, memory))
        digests = register(engine, folders[:m])
        if case == "resident":
            warm_slots(engine, digests)
        run_engine(engine, burst, digests, w.output_len)
        runs[case] = run_stream(engine, stream, digests, w.output_len)
        del engine
        gc.collect()
    return runs


# -- report -----------------------------------------------------------------------------------
def equal_fraction(reference: Sequence[list[int]], outputs: Sequence[list[int]]) -> float:
    return sum(a == b for a, b in zip(reference, outputs, strict=True)) / len(reference)


def figures(
    w: Workload, timed: dict[str, Timed], runs: dict[str, StreamRun], dora: dict[str, Timed]
) -> list[Figure]:
    n, d1 = w.distinct[-1], w.distinct[0]
    ours, one = timed[engine_case(n)], timed["peft-one"]
    b = max(w.peft_batch_sizes, key=lambda b: timed[f"peft-mixed-{b}"].tokens_per_s)
    mixed = timed[f"peft-mixed-{b}"]
    best_peft = max(mixed.tokens_per_s, one.tokens_per_s)
    few, resident = median(runs["few"].ttft), median(runs["resident"].ttft)
    streams = (
        (f"memory of {w.slots} full-rank", runs["few"]),
        (f"all {w.num_adapters} resident", runs["resident"]),
    )
    return [
        Figure(f"(a) tokens/s, {engine_case(n)}", ours.tokens_per_s, "tok/s"),
        Figure(f"(a) tokens/s, PEFT mixed-adapter batches of {b}", mixed.tokens_per_s, "tok/s"),
        Figure("(a) tokens/s, PEFT one adapter at a time", one.tokens_per_s, "tok/s"),
        Figure("(a) engine / best PEFT", ours.tokens_per_s / best_peft, "x", w.speedup_goal),
        Figure(
            "(a) greedy outputs equal to PEFT",
            equal_fraction(one.outputs, ours.outputs),
            "fraction",
            1.0,
        ),
        *(
            Figure(f"(b) tokens/s, {engine_case(d)}", timed[engine_case(d)].tokens_per_s, "tok/s")
            for d in (None, *w.distinct[:-1])
        ),
        Figure(
            f"(b) tokens/s {n} adapters / {d1}",
            ours.tokens_per_s / timed[engine_case(d1)].tokens_per_s,
            "ratio",
            w.spread_goal,
        ),
        *(
            Figure(f"(c) TTFT {stat}, {label}", f(run.ttft) * 1e3, "ms")
            for label, run in streams
            for stat, f in (("median", median), ("p99", lambda v: percentile(v, 99)))
        ),
        Figure(
            f"(c) TTFT median all resident / memory of {w.slots} full-rank",
            resident / few,
            "ratio",
            0.5,
        ),
        Figure(f"(d) tokens/s, {n} DoRA adapters", dora["dora"].tokens_per_s, "tok/s"),
        Figure(f"(d) tokens/s, {n} plain LoRA adapters", dora["plain"].tokens_per_s, "tok/s"),
        Figure(
            "(d) tokens/s DoRA / plain LoRA",
            dora["dora"].tokens_per_s / dora["plain"].tokens_per_s,
            "ratio",
            0.9,
        ),
    ]


def details(
    w: Workload, timed: dict[str, Timed], runs: dict[str, StreamRun], rate: float
) -> dict[str, Any]:
    """Every repetition's seconds, PEFT's agreement with the engine, and the streams."""
    ours = timed[engine_case(w.distinct[-1])].outputs
    cases = {
        case: {"seconds": t.seconds, "tokens": t.tokens, "slot_loads": t.slot_loads}
        for case, t in timed.items()
    }
    for case in (c for c in cases if c.startswith("peft")):
        cases[case]["outputs_equal_to_engine"] = equal_fraction(timed[case].outputs, ours)
    streams: dict[str, Any] = {"arrival_rate_per_s": rate}
    for case, run in runs.items():
        streams[case] = dataclasses.asdict(run) | {
            "busy_fraction": run.busy_seconds / run.seconds,
            "ttft_median_from_add_ms": median(run.added_ttft) * 1e3,
        }
    return {"cases": cases, "streams": streams}


def main(argv: Sequence[str] | None = None) -> Path:
    with prepared_run(__doc__ or NAME, argv) as run:
        settings, model_dir, w = run.settings, run.model_dir, choose_workload(run.settings)
        count = max(w.num_adapters, w.distinct[-1])
        started = time.perf_counter()
        folders = build_demo_adapters(
            model_dir, run.workdir / "adapters", count, seed=w.seed, ranks=w.ranks
        )
        build_seconds = time.perf_counter() - started
        share = demo_adapters_flops_share(model_dir, w.ranks, count)
        timed = measure_batching(settings, model_dir, folders, w)
        rate = w.load * w.num_requests / median(timed[engine_case(w.distinct[-1])].seconds)
        runs = measure_many_adapters(settings, model_dir, folders, w, rate)
        n = w.distinct[-1]
        dora_folders = build_demo_adapters(
            model_dir, run.workdir / "dora", n, seed=w.seed, ranks=w.ranks, dora=True
        )
        dora = measure_dora(settings, model_dir, folders[:n], dora_folders, w)
    workload = dataclasses.asdict(w) | {
        "max_model_len": w.max_model_len,
        "prompt_tokens_from": "uniform over the tokenizer's non-special vocabulary",
        "adapters": f"adapters.demo.build_demo_adapters(seed={w.seed}): adapter i is index i",
        "adapter_flops_share": share,
        "adapter_flops_share_excludes": "attention scores and the embedding lookup",
        "adapter_build_seconds": build_seconds,
        "ignore_eos": True,
    }
    config = dataclasses.asdict(engine_config(settings, Path(), w, w.distinct[-1], w.distinct[-1]))
    config.pop("model")
    config["(c) adapter memory (full-rank adapters), max_cpu_loras"] = {
        "few": [w.slots, w.host],
        "resident": [w.num_adapters] * 2,
    }
    figs, more = figures(w, timed, runs, dora), details(w, timed, runs, rate)
    more["dora"] = {
        kind: {"seconds": t.seconds, "tokens": t.tokens, "slot_loads": t.slot_loads}
        for kind, t in dora.items()
    }
    return report(Result(NAME, settings, run.model, workload, config, figs, more))


if __name__ == "__main__":
    main()
