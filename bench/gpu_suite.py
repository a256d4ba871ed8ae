"""The GPU suite: every `gpu`-marked test, then the engine's GPU benchmarks, in one command that
finishes inside 10 minutes on one H100.

    PYTHONPATH=. python3 -m bench.gpu_suite            # on the GPU machine
    PYTHONPATH=. python3 -m bench.gpu_suite --quick    # CPU smoke: demo model, tiny sizes

Needs python3 with torch 2.11+, triton, transformers, peft, safetensors and tokenizers; no
network. The tests run under pytest: the installed one, or else the wheels carried in
bench/wheels (pytest 9.2 with pluggy, iniconfig, pygments and packaging, pure Python), unpacked
into a temporary folder. The test files are those holding a `gpu` mark, run with `-m gpu` and
without the Redis and PostgreSQL fixtures' plugins (neither package need be installed).

Benchmarks, on a Llama-3-8B-shaped model with seeded random bf16 weights (nothing downloaded;
the demo model in --quick):
1. decode step time at batch 1/8/64/256 (512-token prompts) against the roofline: the bytes a
   step must read (weights, and the KV each request attends over) at the bandwidth of a
   device-to-device copy;
2. LoRA: the decode step at batch 64 with the requests spread over 8 and over 64 adapters
   (rank 16, all seven projections) against all on the base model;
3. decode steps replayed as CUDA graphs against eager ones, at batch 1 to 32;
4. asynchronous scheduling (overlap) against none, at batch 1/8/64.
Three engines are built in turn (the main one, one without graphs, one without overlap), each
freed before the next.
Writes bench/results/gpu_suite-<gpu>.json (gpu_suite-quick.json for --quick).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import argparse
import dataclasses
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, Figure, Result, RunSettings, available_cores, configure
from bench.common import report as write_report
from bench.decode_steps import (
    copy_bandwidth,
    step_bytes,
    time_decode,
    with_engine,
)
from bench.lora_overhead import write_adapter
from bench.models import describe_model, llama3_8b_config, shapes_only_folder
from loramux.adapters.base_spec import BaseModelSpec
from loramux.engine.config import EngineConfig
from loramux.engine.demo_model import build_demo_model
from loramux.engine.llm_engine import LLMEngine

NAME = "gpu_suite"
ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "bench" / "wheels"
"""Wheels of what the suite needs beyond IMAGE_PACKAGES (pytest), put on the tests' path."""
IMAGE_PACKAGES = ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "httpx")
"""What the GPU machine has installed (with their dependencies): everything else the suite and
its tests import must travel in WHEELS (tests/bench/test_gpu_suite_imports.py checks it)."""
ROOFLINE_GOAL = 0.5
"""Batches of 64 and more should reach half the roofline (smaller ones are launch-bound)."""
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


# -- the tests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TestRun:
    files: list[str]
    collected: int
    passed: int
    skipped: int
    failed: list[str]
    """Ids of tests that failed or errored."""
    seconds: float
    pytest: str
    """Where pytest came from: "installed" or "bench/wheels"."""
    output_tail: str


def gpu_test_files() -> list[Path]:
    """Test files holding a `gpu` mark."""
    return sorted(
        p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def run_gpu_tests(timeout_s: int) -> TestRun:
    """Run every `gpu` test in a child process; its outcome, read from a JUnit report."""
    files = [str(p.relative_to(ROOT)) for p in gpu_test_files()]
    with tempfile.TemporaryDirectory(prefix="loramux-gpu-tests-") as tmp:
        paths = [str(ROOT)]
        source = "installed"
        if importlib.util.find_spec("pytest") is None:
            paths.append(str(unpack_wheels(Path(tmp) / "wheels")))
            source = "bench/wheels"
        env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "no:tests.redis", "-p", "no:tests.postgres"]
        command += ["-m", "gpu", f"--junitxml={report}", *files]
        started = time.monotonic()
        try:
            proc = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            tail = out.decode(errors="replace") if isinstance(out, bytes) else out
            return TestRun(
                files, 0, 0, 0, [f"timed out after {timeout_s} s"], timeout_s, source, tail[-4000:]
            )
        seconds = time.monotonic() - started
        tail = (proc.stdout + proc.stderr)[-4000:]
        if not report.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}):\n{tail}")
        return _read_junit(report, files, seconds, source, tail)


def unpack_wheels(dest: Path) -> Path:
    """The carried wheels, unpacked into `dest` (a folder to put on sys.path)."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pytest is not installed and {WHEELS} holds no wheels")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(dest)
    return dest


def _read_junit(report: Path, files: list[str], seconds: float, source: str, tail: str) -> TestRun:
    cases = ET.parse(report).getroot().iter("testcase")
    failed: list[str] = []
    skipped = collected = 0
    for case in cases:
        collected += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
    passed = collected - skipped - len(failed)
    return TestRun(files, collected, passed, skipped, failed, seconds, source, tail)


# -- the benchmarks -------------------------------------------------------------------------
def engine_config(settings: RunSettings, folder: Path, w: Workload) -> EngineConfig:
    """The suite's main engine: overlapped steps, adapter slots for the largest count."""
    return settings.engine(
        max_model_len=w.max_model_len,
        max_num_seqs=max(w.batches),
        max_num_batched_tokens=w.max_num_batched_tokens,
        kv_cache_mb=w.kv_cache_mb,
        max_loras=max(w.adapter_counts),
        max_cpu_loras=max(w.adapter_counts),
        max_lora_rank=16,
        async_scheduling=True,
    ).engine_config(folder, random_weights=settings.model_size == "llama3-8b")


def measure_main(
    engine: LLMEngine, w: Workload, adapters: list[Path], bandwidth: float
) -> dict[str, Any]:
    """Decode steps against the roofline, at the graph batches, then with adapters, on the
    main engine."""
    rng = random.Random(0)
    time_decode(engine, [None], w.prompt_len, 1, 2, rng)  # compile and warm up
    roofline = []
    for batch in w.batches:
        timing = time_decode(engine, [None] * batch, w.prompt_len, w.warmup_steps, w.steps, rng)
        bound_ms = step_bytes(engine, timing) / bandwidth * 1e3
        roofline.append(
            asdict(timing) | {"bytes": step_bytes(engine, timing), "roofline_ms": bound_ms}
        )
    graphs = [
        asdict(time_decode(engine, [None] * b, w.prompt_len, w.warmup_steps, w.steps, rng))
        for b in w.graph_batches
    ]
    digests = [engine.register_adapter(folder) for folder in adapters]
    lora: dict[str, float] = {}
    for count in (0, *w.adapter_counts):
        spread = [digests[i % count] if count else None for i in range(w.lora_batch)]
        timing = time_decode(engine, spread, w.prompt_len, w.warmup_steps, w.steps, rng)
        lora[f"{count}_adapters_ms"] = timing.step_ms
    return {"roofline": roofline, "graphs": graphs, "lora": lora}


def measure_batches(engine: LLMEngine, w: Workload, batches: Sequence[int]) -> list[dict[str, Any]]:
    rng = random.Random(1)
    time_decode(engine, [None], w.prompt_len, 1, 2, rng)
    return [
        asdict(time_decode(engine, [None] * b, w.prompt_len, w.warmup_steps, w.steps, rng))
        for b in batches
    ]


def run_benchmarks(settings: RunSettings, workdir: Path, w: Workload) -> dict[str, Any]:
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
    main = with_engine(config, lambda e: measure_main(e, w, adapters, bandwidth))
    eager_config = dataclasses.replace(config, cuda_graphs=False, max_num_seqs=max(w.graph_batches))
    eager = with_engine(eager_config, lambda e: measure_batches(e, w, w.graph_batches))
    sync_config = dataclasses.replace(
        config, async_scheduling=False, max_num_seqs=max(w.overlap_batches)
    )
    sync = with_engine(sync_config, lambda e: measure_batches(e, w, w.overlap_batches))
    settings_out = asdict(config)
    settings_out.pop("model")
    return {
        "model": describe_model(folder, name, settings.dtype, settings.device),
        "engine_settings": settings_out,
        "copy_bandwidth_bytes_per_s": bandwidth,
        **main,
        "eager": eager,
        "no_overlap": sync,
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
    for r in bench["roofline"]:
        b = r["batch"]
        out.append(Figure(f"decode step, batch {b}", r["step_ms"], "ms"))
        goal = ROOFLINE_GOAL if b >= 64 and cuda else None
        out.append(
            Figure(
                f"roofline / decode step, batch {b}", r["roofline_ms"] / r["step_ms"], "ratio", goal
            )
        )
    lora = bench["lora"]
    for count in (k for k in lora if not k.startswith("0_")):
        adapters = int(count.split("_")[0])
        goal = LORA_GOAL if adapters <= 8 and cuda else None
        ratio = lora["0_adapters_ms"] / lora[count]
        out.append(Figure(f"decode step base / LoRA, {adapters} adapters", ratio, "ratio", goal))
    graphs = {r["batch"]: r["step_ms"] for r in bench["graphs"]}
    for r in bench["eager"]:
        ratio = r["step_ms"] / graphs[r["batch"]]
        out.append(
            Figure(
                f"eager / CUDA graphs, batch {r['batch']}", ratio, "ratio", 1.0 if cuda else None
            )
        )
    overlapped = {r["batch"]: r["step_ms"] for r in bench["roofline"]}
    for r in bench["no_overlap"]:
        ratio = r["step_ms"] / overlapped[r["batch"]]
        out.append(
            Figure(
                f"no overlap / overlap, batch {r['batch']}", ratio, "ratio", 1.0 if cuda else None
            )
        )
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
            bench = run_benchmarks(settings, Path(tmp), w)
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
    return path


if __name__ == "__main__":
    written = main()
    failed = __import__("json").loads(written.read_text())["details"]["tests"]
    raise SystemExit(1 if failed and failed["failed"] else 0)
