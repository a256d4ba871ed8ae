"""Engine throughput on a mixed-length workload against transformers' static batching, and how
much of the allocated KV cache actually holds tokens.

Workload: N requests with prompt and output lengths drawn uniformly from ranges (seeded); prompt
tokens drawn uniformly from the tokenizer's non-special vocabulary; EOS is ignored, so every
request produces exactly its output length.

- Engine: every request submitted at once, then `step()` until idle (continuous batching), on a
  fresh engine each round (a reused one would find the prompts in its prefix cache).
- Reference: `transformers` `generate`, greedy, in static batches of B requests taken in
  submission order, left-padded with an attention mask. A static batch runs until its longest
  output (max_new_tokens = the batch's maximum) and only the requested tokens count as output.
  Several B are tried; the fastest is the reference.
- Both sides run `rounds` times, alternating, and each keeps its fastest round: the machine may
  be shared, and other processes only ever slow a run down.
- KV efficiency: after every engine step, tokens whose K/V are stored (the running sequences'
  computed tokens) over the slots of the blocks they hold; reported at the step holding the most
  blocks, beside what reserving max_model_len per running sequence would give.
- Correctness: a few requests run alone through `generate` must equal the engine's greedy
  outputs token for token.

Run: `python -m bench.engine_throughput [--quick] [--device cuda --model-size 1b]`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import Figure, Result, RunSettings, Stopwatch, run_benchmark
from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, EngineStats
from loramux.engine.sampling import SamplingParams

NAME = "engine_throughput"


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]
    """Inclusive range prompt lengths are drawn from."""
    output_lens: tuple[int, int]
    """Inclusive range output lengths are drawn from."""
    hf_batch_sizes: tuple[int, ...]
    num_checked: int
    """Requests (the shortest) re-run alone through transformers to check greedy outputs."""
    rounds: int
    """Alternating runs of each side; each side keeps its fastest."""
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prompt_lens[1] + self.output_lens[1]


WORKLOADS = {
    "full": Workload(64, (16, 512), (16, 256), (8, 16, 32, 64), num_checked=3, rounds=2),
    "quick": Workload(32, (16, 256), (16, 64), (8, 16), num_checked=2, rounds=2),
    "smoke": Workload(4, (8, 32), (4, 8), (2, 4), num_checked=1, rounds=1),
}


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: list[int]
    output_len: int


def make_requests(workload: Workload, tokenizer: Any) -> list[BenchRequest]:
    """The workload's requests, the same for every run with the same seed and tokenizer."""
    rng = random.Random(workload.seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    requests = []
    for i in range(workload.num_requests):
        prompt_len = rng.randint(*workload.prompt_lens)
        output_len = rng.randint(*workload.output_lens)
        prompt = [rng.choice(vocab) for _ in range(prompt_len)]
        requests.append(BenchRequest(f"req-{i}", prompt, output_len))
    return requests


# -- engine -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvSample:
    """KV usage of the running sequences after one step."""

    running: int
    tokens_stored: int
    slots_allocated: int
    """Distinct blocks held by running sequences × block size."""
    slots_preallocated: int
    """Running sequences × max_model_len: what reserving the longest context per request takes."""

    @property
    def efficiency(self) -> float:
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 0.0

    @property
    def preallocated_efficiency(self) -> float:
        return self.tokens_stored / self.slots_preallocated if self.slots_preallocated else 0.0


def kv_sample(engine: LLMEngine) -> KvSample:
    running = engine.scheduler.running
    blocks = {b for seq in running for b in seq.block_table}
    return KvSample(
        running=len(running),
        tokens_stored=sum(seq.num_computed_tokens for seq in running),
        slots_allocated=len(blocks) * engine.block_manager.block_size,
        slots_preallocated=len(running) * engine.max_model_len,
    )


def engine_config(settings: RunSettings, model_dir: Path, workload: Workload) -> EngineConfig:
    """Defaults suited to the device: a bigger step budget and KV pool on a GPU."""
    return settings.engine(max_model_len=workload.max_model_len, max_num_seqs=64).engine_config(
        model_dir
    )


@dataclass(frozen=True)
class EngineRun:
    seconds: float
    cpu_seconds: float
    outputs: dict[str, list[int]]
    peak: KvSample
    stats: EngineStats
    """Counters of this run alone (the warm-up subtracted)."""


# EngineStats fields that count since start (the others are gauges).
_COUNTERS = "prefix_cache_hit_tokens prompt_tokens_computed generated_tokens preemptions steps"


def run_engine(engine: LLMEngine, requests: Sequence[BenchRequest], device: str) -> EngineRun:
    """Submit every request at once and step until idle; KV usage is sampled after each step."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    before = engine.stats()
    peak = kv_sample(engine)
    with Stopwatch(device) as watch:
        for r in requests:
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(EngineRequest(r.request_id, params, prompt_token_ids=r.prompt))
        while engine.has_work:
            for out in engine.step():
                outputs[out.request_id].extend(out.token_ids)
            sample = kv_sample(engine)
            if sample.slots_allocated > peak.slots_allocated:
                peak = sample
    after = engine.stats()
    delta = {c: getattr(after, c) - getattr(before, c) for c in _COUNTERS.split()}
    stats = dataclasses.replace(after, **delta)
    return EngineRun(watch.seconds, watch.cpu_seconds, outputs, peak, stats)


# -- transformers -----------------------------------------------------------------------------
def hf_generate(
    model: Any, prompts: Sequence[list[int]], max_new: int, pad_id: int, device: str
) -> list[list[int]]:
    """Greedy continuations of exactly `max_new` tokens (EOS disabled), left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


@dataclass(frozen=True)
class HfRun:
    batch_size: int
    seconds: float
    cpu_seconds: float
    useful_tokens: int
    """Requested output tokens: what the engine produces for the same requests."""
    generated_tokens: int
    """Tokens decoded including those past a request's own length (batch rows × batch max)."""
    outputs: dict[str, list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def run_hf(
    model: Any, requests: Sequence[BenchRequest], batch_size: int, pad_id: int, device: str
) -> HfRun:
    outputs: dict[str, list[int]] = {}
    generated = 0
    with Stopwatch(device) as watch:
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            max_new = max(r.output_len for r in batch)
            rows = hf_generate(model, [r.prompt for r in batch], max_new, pad_id, device)
            generated += max_new * len(batch)
            for r, row in zip(batch, rows, strict=True):
                outputs[r.request_id] = row[: r.output_len]
    useful = sum(r.output_len for r in requests)
    return HfRun(batch_size, watch.seconds, watch.cpu_seconds, useful, generated, outputs)


def check_greedy(
    model: Any,
    requests: Sequence[BenchRequest],
    engine_outputs: dict[str, list[int]],
    pad_id: int,
    device: str,
) -> list[dict[str, Any]]:
    """Run each request alone through transformers; where does the engine's output first differ?"""
    checks = []
    for r in requests:
        expected = hf_generate(model, [r.prompt], r.output_len, pad_id, device)[0]
        got = engine_outputs[r.request_id]
        pairs = enumerate(zip(expected, got, strict=True))
        mismatch = next((i for i, (a, b) in pairs if a != b), None)
        checks.append(
            {
                "request_id": r.request_id,
                "prompt_len": len(r.prompt),
                "output_len": r.output_len,
                "equal": mismatch is None,
                "first_mismatch": mismatch,
            }
        )
    return checks


def agreement(reference: dict[str, list[int]], outputs: dict[str, list[int]]) -> float:
    """Fraction of requests whose whole output equals the reference's."""
    return sum(outputs[k] == v for k, v in reference.items()) / len(reference)


# -- the benchmark ----------------------------------------------------------------------------
def warm_up_requests(workload: Workload) -> list[BenchRequest]:
    """The shortest and the longest prompt of the workload's range, with a few decode steps:
    run through each side first so that one-time work (allocations, kernel compilation for each
    shape class) is not timed."""
    lengths = workload.prompt_lens
    return [BenchRequest(f"warm-up-{n}", [10 + i % 64 for i in range(n)], 2) for n in lengths]


def fresh_engine(config: EngineConfig, workload: Workload) -> LLMEngine:
    engine = LLMEngine(config)
    run_engine(engine, warm_up_requests(workload), config.device)
    return engine


@dataclass(frozen=True)
class Measurements:
    requests: list[BenchRequest]
    config: EngineConfig
    engine_rounds: list[EngineRun]
    hf_rounds: list[list[HfRun]]
    """Per round, one run per batch size."""
    checks: list[dict[str, Any]]

    @property
    def useful_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def engine(self) -> EngineRun:
        """The fastest round."""
        return min(self.engine_rounds, key=lambda r: r.seconds)

    @property
    def hf(self) -> list[HfRun]:
        """The fastest round of each batch size."""
        by_size = zip(*self.hf_rounds, strict=True)
        return [min(runs, key=lambda h: h.seconds) for runs in by_size]

    @property
    def best_hf(self) -> HfRun:
        return max(self.hf, key=lambda h: h.tokens_per_s)


def measure(settings: RunSettings, model_dir: Path, workload: Workload) -> Measurements:
    """Both sides on the same requests, alternating round by round in this process."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id, device = tokenizer.pad_token_id, settings.device
    requests = make_requests(workload, tokenizer)
    config = engine_config(settings, model_dir, workload)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=config.torch_dtype)
    model = model.to(device).eval()
    run_hf(model, warm_up_requests(workload), 2, pad_id, device)
    engine_rounds, hf_rounds = [], []
    for _ in range(workload.rounds):
        run = run_engine(fresh_engine(config, workload), requests, device)
        assert all(len(run.outputs[r.request_id]) == r.output_len for r in requests)
        engine_rounds.append(run)
        hf_rounds.append(
            [run_hf(model, requests, b, pad_id, device) for b in workload.hf_batch_sizes]
        )
    cheapest = sorted(requests, key=lambda r: len(r.prompt) + r.output_len)
    checked = cheapest[: workload.num_checked]
    checks = check_greedy(model, checked, engine_rounds[-1].outputs, pad_id, device)
    return Measurements(requests, config, engine_rounds, hf_rounds, checks)


def figures(m: Measurements) -> list[Figure]:
    engine_tps = m.useful_tokens / m.engine.seconds
    best = m.best_hf
    equal = sum(c["equal"] for c in m.checks) / len(m.checks)
    peak = m.engine.peak
    return [
        Figure("engine output tokens/s", engine_tps, "tok/s"),
        Figure(f"transformers tokens/s (batch {best.batch_size})", best.tokens_per_s, "tok/s"),
        Figure("throughput engine / transformers", engine_tps / best.tokens_per_s, "x", 2.0),
        Figure("KV efficiency at peak (stored / allocated)", peak.efficiency, "ratio", 0.9),
        Figure("KV efficiency preallocating max_model_len", peak.preallocated_efficiency, "ratio"),
        Figure("greedy outputs equal to transformers", equal, "fraction", 1.0),
    ]


def details(m: Measurements) -> dict[str, Any]:
    return {
        "engine": {
            "seconds": m.engine.seconds,
            "cpu_seconds": m.engine.cpu_seconds,
            "seconds_per_round": [r.seconds for r in m.engine_rounds],
            "stats": dataclasses.asdict(m.engine.stats),
            "kv_peak": dataclasses.asdict(m.engine.peak),
        },
        "transformers": [
            {
                "batch_size": h.batch_size,
                "seconds": h.seconds,
                "cpu_seconds": h.cpu_seconds,
                "seconds_per_round": [r[i].seconds for r in m.hf_rounds],
                "useful_tokens": h.useful_tokens,
                "generated_tokens": h.generated_tokens,
                "tokens_per_s": h.tokens_per_s,
                "outputs_equal_to_engine": agreement(h.outputs, m.engine.outputs),
            }
            for i, h in enumerate(m.hf)
        ],
        "throughput_ratio_by_cpu_time": m.best_hf.cpu_seconds / m.engine.cpu_seconds,
        "reference_batch_size": m.best_hf.batch_size,
        "greedy_check": m.checks,
    }


def summarize(
    settings: RunSettings, model: dict[str, Any], workload: Workload, m: Measurements
) -> Result:
    workload_info = dataclasses.asdict(workload) | {
        "max_model_len": workload.max_model_len,
        "prompt_tokens": sum(len(r.prompt) for r in m.requests),
        "output_tokens": m.useful_tokens,
        "prompt_tokens_from": "uniform over the tokenizer's non-special vocabulary",
        "ignore_eos": True,
        "submission": "engine: all at once; transformers: static batches in submission order",
    }
    engine_settings = dataclasses.asdict(m.config)
    del engine_settings["model"]  # a temporary folder; `model` describes it
    return Result(NAME, settings, model, workload_info, engine_settings, figures(m), details(m))


def benchmark(settings: RunSettings, model_dir: Path, model: dict[str, Any]) -> Result:
    workload = WORKLOADS[settings.mode]
    return summarize(settings, model, workload, measure(settings, model_dir, workload))


def main(argv: Sequence[str] | None = None) -> Path:
    return run_benchmark(__doc__ or NAME, argv, benchmark)


if __name__ == "__main__":
    main()
