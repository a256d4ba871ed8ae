"""The GPU suite: every `gpu`-marked test, then the engine's GPU benchmarks, in one command that
finishes inside 10 minutes on one H100.

    PYTHONPATH=. python3 -m bench.gpu_suite            # on the GPU machine
    PYTHONPATH=. python3 -m bench.gpu_suite --quick    # CPU smoke: demo model, tiny sizes

Needs python3 with torch 2.11+, triton, transformers, peft, safetensors and tokenizers; no
network. What else it imports travels as wheels in bench/wheels, unpacked where missing
(bench.carried_wheels). The tests (bench.gpu_tests) are the files holding a `gpu` mark, run
with `-m gpu` by the installed pytest or the carried one, without the Redis and PostgreSQL
fixtures' plugins (neither package need be installed).

Benchmarks, on a Llama-3-8B-shaped model with seeded random bf16 weights (nothing downloaded;
the demo model in --quick):
1. decode step time at batch 1/8/64/256 (512-token prompts) against the roofline: the bytes a
   step must read (weights, and the KV each request attends over) at the bandwidth of a
   device-to-device copy;
2. LoRA: the decode step at batch 64 with the requests spread over 8 and over 64 adapters
   (rank 16, all seven projections) against all on the base model;
3. decode steps replayed as CUDA graphs against eager ones, at batch 1 to 32;
4. asynchronous scheduling (overlap) against none, at batch 1/8/64;
5. the fused kernels (residual add + RMSNorm, rotary embedding + KV cache write) against their
   torch forms (EngineConfig.fused_kernels), at batch 1/8/64.
Four engines are built in turn (the main one, one without graphs, one without overlap, one
without the fused kernels), each freed before the next.
Writes bench/results/gpu_suite-<gpu>.json (gpu_suite-quick.json for --quick).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench import carried_wheels
from bench.common import RESULTS_DIR, Figure, Result, RunSettings, available_cores, configure
from bench.common import report as write_report
from bench.decode_steps import (
    copy_bandwidth,
    step_bytes,
    time_decode,
    with_engine,
)
from bench.gpu_tests import TestRun, run_gpu_tests
from bench.lora_overhead import write_adapter
from bench.models import describe_model, llama3_8b_config, shapes_only_folder
from loramux.adapters.base_spec import BaseModelSpec
from loramux.engine.config import EngineConfig
from loramux.engine.demo_model import build_demo_model
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.lora.memory import full_rank_bytes

NAME = "gpu_suite"
WHEELS = carried_wheels.WHEELS
"""Wheels of what the suite needs beyond IMAGE_PACKAGES (pytest, llguidance, ...)."""
ROOFLINE_GOAL = 0.7
"""Batches of 64 and more should reach 0.7 of the roofline (smaller ones are launch-bound)."""
LORA_GOAL = 1 / 1.1
"""8 adapters add under 10% to a decode step (64 adapters read 64 adapters' weights: no goal)."""


@dataclass(frozen=True)
class Workload:
    batches: tuple[int, ...]
    prompt_len: int
    warmup_steps: int
    steps: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_cache_mb: int
    lora_batch: int
    adapter_counts: tuple[int, ...]
    graph_batches: tuple[int, ...]
    overlap_batches: tuple[int, ...]
    """A subset of `batches`."""
    copy_bytes: int
    copy_iters: int
    tests_timeout_s: int


WORKLOADS = {
    "full": Workload(
        (1, 8, 64, 256), 512, 3, 20, 1024, 8192, 24 << 10, 64, (8, 64), (1, 2, 4, 8, 16, 32),
        (1, 8, 64), 1 << 30, 20, 360,
    ),
    "quick": Workload(
        (1, 2, 4), 16, 1, 3, 64, 64, 64, 4, (2, 4), (1, 2), (1, 4), 1 << 24, 3, 360,
    ),
}  # fmt: skip


# -- the benchmarks -------------------------------------------------------------------------
def engine_config(settings: RunSettings, folder: Path, w: Workload) -> EngineConfig:
    """The suite's main engine: overlapped steps, adapter slots and adapter memory for the
    largest count at rank 16 on every projection (the default memory holds 8 such adapters, and
    64 requests on 64 adapters would then run 8 at a time)."""
    rank, adapters = 16, max(w.adapter_counts)
    config = settings.engine(
        max_model_len=w.max_model_len,
        max_num_seqs=max(w.batches),
        max_num_batched_tokens=w.max_num_batched_tokens,
        kv_cache_mb=w.kv_cache_mb,
        max_loras=adapters,
        max_cpu_loras=adapters,
        max_lora_rank=rank,
        async_scheduling=True,
    ).engine_config(folder, random_weights=settings.model_size == "llama3-8b")
    base = BaseModelSpec.from_model_dir(folder)
    memory = full_rank_bytes(base, adapters, rank, config.torch_dtype)
    return dataclasses.replace(config, lora_memory_bytes=memory)


def measure_main(
    engine: LLMEngine,
    w: Workload,
    adapters: list[Path],
    bandwidth: float,
    profile_steps: bool = False,
) -> dict[str, Any]:
    """Decode steps against the roofline, at the graph batches, then with adapters, on the
    main engine; each part on its own (a part that fails is recorded in "errors")."""
    rng = random.Random(0)
    out: dict[str, Any] = {}
    section(out, "warmup", lambda: asdict(time_decode(engine, [None], w.prompt_len, 1, 2, rng)))

    def roofline() -> list[dict[str, Any]]:
        rows = []
        for batch in w.batches:
            t = time_decode(engine, [None] * batch, w.prompt_len, w.warmup_steps, w.steps, rng)
            nbytes = step_bytes(engine, t)
            rows.append(asdict(t) | {"bytes": nbytes, "roofline_ms": nbytes / bandwidth * 1e3})
        return rows

    def lora() -> dict[str, float]:
        began = time.monotonic()
        with ThreadPoolExecutor(8) as pool:  # registration is safe from any thread
            digests = list(pool.map(engine.register_adapter, adapters))
        seconds = out["lora_wall_seconds"] = {"register": time.monotonic() - began}
        times: dict[str, float] = {}
        for count in (0, *w.adapter_counts):
            began = time.monotonic()
            spread = [digests[i % count] if count else None for i in range(w.lora_batch)]
            t = time_decode(engine, spread, w.prompt_len, w.warmup_steps, w.steps, rng)
            times[f"{count}_adapters_ms"] = t.step_ms
            seconds[f"{count}_adapters"] = time.monotonic() - began
        return times

    def profile() -> str:
        """Where a decode step's device time goes: the kernels of a few steps at the LoRA
        batch, by total CUDA time (a table; the JSON keeps its first lines)."""
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        prof = torch.profiler.profile(activities=activities)
        time_decode(engine, [None] * w.lora_batch, w.prompt_len, 1, 5, rng, around=prof)
        table: str = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
        print(table, flush=True)
        return table

    section(out, "roofline", roofline)
    section(out, "graphs", lambda: measure_batches(engine, w, w.graph_batches, rng))
    if profile_steps and engine.config.device.startswith("cuda"):
        section(out, "profile", profile)
    section(out, "lora", lora)
    return out


def measure_batches(
    engine: LLMEngine, w: Workload, batches: Sequence[int], rng: random.Random | None = None
) -> list[dict[str, Any]]:
    if rng is None:  # a fresh engine: compile and warm up first
        rng = random.Random(1)
        time_decode(engine, [None], w.prompt_len, 1, 2, rng)
    return [
        asdict(time_decode(engine, [None] * b, w.prompt_len, w.warmup_steps, w.steps, rng))
        for b in batches
    ]


def section(out: dict[str, Any], name: str, measure: Callable[[], Any]) -> None:
    """out[name] = measure(), timed and printed as it ends; a failure goes to out["errors"]
    with its traceback, and the suite goes on (one GPU run must tell all it can)."""
    started = time.monotonic()
    print(f"[gpu_suite] {name} ...", flush=True)
    try:
        out[name] = measure()
    except Exception as exc:
        out.setdefault("errors", {})[name] = traceback.format_exc()[-8000:]
        print(f"[gpu_suite] {name} FAILED: {exc!r}\n{traceback.format_exc()}", flush=True)
        return
    took = time.monotonic() - started
    print(f"[gpu_suite] {name} done in {took:.1f} s: {json.dumps(out[name])}", flush=True)


def run_benchmarks(
    settings: RunSettings, workdir: Path, w: Workload, profile: bool = False
) -> dict[str, Any]:
    demo = settings.model_dir or build_demo_model(workdir / "demo")
    if settings.model_size == "llama3-8b":
        folder = shapes_only_folder(llama3_8b_config(), demo, workdir / "llama3-8b")
        name = "llama-3-8b-shaped, seeded random weights (bench.models.llama3_8b_config)"
    else:
        folder, name = demo, "demo (engine.demo_model, seed 0)"
    base = BaseModelSpec.from_model_dir(folder)
    adapters = [
        write_adapter(workdir / f"adapter-{i}", base, 16, seed=i, device=settings.device)
        for i in range(max(w.adapter_counts))
    ]
    bandwidth = copy_bandwidth(w.copy_bytes, settings.device, w.copy_iters)
    config = engine_config(settings, folder, w)
    out: dict[str, Any] = {}
    section(
        out,
        "main",
        lambda: with_engine(config, lambda e: measure_main(e, w, adapters, bandwidth, profile)),
    )
    main = out.pop("main", {})
    # Engines that each turn one thing off, timed at the batches of the part they compare with.
    replace = dataclasses.replace
    graphs, overlap = w.graph_batches, w.overlap_batches
    variants = (
        ("eager", replace(config, cuda_graphs=False, max_num_seqs=max(graphs)), graphs),
        ("no_overlap", replace(config, async_scheduling=False, max_num_seqs=max(overlap)), overlap),
        ("unfused", replace(config, fused_kernels=False, max_num_seqs=max(overlap)), overlap),
    )
    for part, variant, batches in variants:
        timed = partial(measure_batches, w=w, batches=batches)
        section(out, part, partial(with_engine, variant, timed))
    errors = {**main.pop("errors", {}), **out.pop("errors", {})}
    settings_out = asdict(config)
    settings_out.pop("model")
    return {
        "model": describe_model(folder, name, settings.dtype, settings.device),
        "engine_settings": settings_out,
        "copy_bandwidth_bytes_per_s": bandwidth,
        **main,
        **out,
        "errors": errors,
    }


# -- the result -----------------------------------------------------------------------------
def figures(tests: TestRun | None, bench: dict[str, Any] | None, cuda: bool) -> list[Figure]:
    out: list[Figure] = []
    if tests is not None:
        runnable = tests.collected - tests.skipped
        goal = float(tests.collected) if cuda else None
        out.append(Figure("gpu tests passed", tests.passed, "tests", goal))
        out.append(Figure("gpu tests not passed", runnable - tests.passed, "tests"))
    if bench is None:
        return out
    out.append(Figure("copy bandwidth", bench["copy_bandwidth_bytes_per_s"] / 1e9, "GB/s"))
    out.append(Figure("benchmark parts failed", len(bench["errors"]), "parts", None))
    for r in bench.get("roofline", []):
        b = r["batch"]
        out.append(Figure(f"decode step, batch {b}", r["step_ms"], "ms"))
        goal = ROOFLINE_GOAL if b >= 64 and cuda else None
        out.append(
            Figure(
                f"roofline / decode step, batch {b}", r["roofline_ms"] / r["step_ms"], "ratio", goal
            )
        )
    lora = bench.get("lora", {})
    for count, ms in lora.items():  # absolute too: the ratio's base changed with no-LoRA graphs
        out.append(
            Figure(f"decode step at the LoRA batch, {count.split('_')[0]} adapters", ms, "ms")
        )
    for count in (k for k in lora if not k.startswith("0_")):
        adapters = int(count.split("_")[0])
        goal = LORA_GOAL if adapters <= 8 and cuda else None
        ratio = lora["0_adapters_ms"] / lora[count]
        out.append(Figure(f"decode step base / LoRA, {adapters} adapters", ratio, "ratio", goal))
    pairs = (
        ("graphs", "eager", "eager / CUDA graphs"),
        ("roofline", "no_overlap", "no overlap / overlap"),
        ("roofline", "unfused", "torch ops / fused kernels"),
    )
    for fast, slow, label in pairs:
        fast_ms = {r["batch"]: r["step_ms"] for r in bench.get(fast, [])}
        for r in bench.get(slow, []):
            if r["batch"] in fast_ms:
                ratio = r["step_ms"] / fast_ms[r["batch"]]
                goal = 1.0 if cuda else None
                out.append(Figure(f"{label}, batch {r['batch']}", ratio, "ratio", goal))
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[RunSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke: demo model, tiny sizes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model-dir", type=Path, default=None, help="the demo model, if built")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-benchmarks", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="CUDA: profile a few decode steps' kernels"
    )
    given = tuple(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    cuda = args.device.startswith("cuda")
    if not (args.quick or cuda):
        raise SystemExit("the full suite needs a CUDA device; --quick runs the CPU smoke")
    settings = RunSettings(
        mode="quick" if args.quick else "full",
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        model_size="demo" if args.quick else "llama3-8b",
        model_dir=args.model_dir,
        results_dir=args.results_dir,
        threads=args.threads or available_cores(),
        argv=given,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> Path:
    settings, args = parse_args(argv)
    configure(settings)
    w = WORKLOADS[settings.mode]
    tests = None if args.skip_tests else run_gpu_tests(w.tests_timeout_s)
    bench: dict[str, Any] | None = None
    if not args.skip_benchmarks:
        with tempfile.TemporaryDirectory(prefix="loramux-gpu-suite-") as tmp:
            bench = run_benchmarks(settings, Path(tmp), w, args.profile)
    details: dict[str, Any] = {"tests": asdict(tests) if tests else None}
    details |= {k: v for k, v in (bench or {}).items() if k not in ("model", "engine_settings")}
    model = (bench or {}).get("model", {"name": "none (benchmarks skipped)", "parameters": 0})
    result = Result(
        NAME,
        settings,
        model,
        asdict(w),
        (bench or {}).get("engine_settings", {}),
        figures(tests, bench, settings.is_cuda),
        details,
    )
    path = write_report(result)
    if tests is not None and tests.failed:
        print("failed gpu tests:\n  " + "\n  ".join(tests.failed))
    if bench is not None and bench["errors"]:
        print("failed benchmark parts: " + ", ".join(bench["errors"]))
    return path


def failures(result: dict[str, Any]) -> int:
    """Failed gpu tests and benchmark parts in a written result."""
    details = result["details"]
    return len((details["tests"] or {}).get("failed", [])) + len(details.get("errors", {}))


if __name__ == "__main__":
    written = main()
    raise SystemExit(1 if failures(json.loads(written.read_text())) else 0)
