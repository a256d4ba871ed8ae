"""What every benchmark shares: the command line, the model it runs (bench.models), the
machine it ran on, timing, the printed table and the JSON result file.

A result file is one JSON object:
    benchmark, mode ("full" | "quick" | "smoke"), command, created (UTC, ISO 8601),
    machine {cpu, cores, torch_threads, load_average (1/5/15 min, when written), platform, python,
             torch, transformers, [gpu, triton]},
    model {name, dtype, device, architecture sizes, parameters},
    workload {...}, settings {...},
    figures [{name, value, unit, goal, met}],   goal: ">= x", "<= x" or null; met: bool or null
    details {...}
Full runs write `bench/results/<name>.json` (`<name>-<gpu>.json` on CUDA); a run on the
`realistic` model size adds `-realistic`, quick and smoke runs `-quick` / `-smoke`, so they never
overwrite a demo-size or full result.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from bench.models import prepare_model
from loramux.gateway.serve_workers import available_cores
from loramux.gateway.settings import EngineSettings

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class RunSettings:
    """What the command line chose: mode, device, dtype and model."""

    mode: str
    device: str
    dtype: str
    model_size: str
    model_dir: Path | None
    results_dir: Path
    threads: int
    argv: tuple[str, ...]
    """The arguments as given, recorded in the result's `command`."""

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def engine(self, **fields: Any) -> EngineSettings:
        """Engine settings of this run's dtype and device, sized for the device (a bigger step
        budget and KV pool on a GPU) where `fields` do not say otherwise; their `engine_config`
        is the benchmark's EngineConfig, mapped as serve's engine maps its own."""
        sized = {
            "max_num_batched_tokens": 2048 if self.is_cuda else 512,
            "kv_cache_mb": 8 << 10 if self.is_cuda else 256,
        }
        return EngineSettings(**{"dtype": self.dtype, "device": self.device, **sized, **fields})


@dataclass(frozen=True)
class Figure:
    """One reported number; `goal_min` is the value it should reach, None when it has no goal."""

    name: str
    value: float
    unit: str
    goal_min: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.goal_min is None else self.value >= self.goal_min

    def as_dict(self) -> dict[str, Any]:
        goal = None if self.goal_min is None else f">= {self.goal_min:g}"
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "goal": goal,
            "met": self.met,
        }


@dataclass(frozen=True)
class CeilingFigure(Figure):
    """A figure whose goal is an upper bound (`Figure` only knows lower bounds)."""

    goal_max: float | None = None

    @property
    def met(self) -> bool | None:
        return None if self.goal_max is None else self.value <= self.goal_max

    def as_dict(self) -> dict[str, Any]:
        goal = None if self.goal_max is None else f"<= {self.goal_max:g}"
        return {**super().as_dict(), "goal": goal}


@dataclass(frozen=True)
class Result:
    """Everything a benchmark writes; `figures` are what the table shows."""

    benchmark: str
    settings: RunSettings
    model: dict[str, Any]
    workload: dict[str, Any]
    engine_settings: dict[str, Any]
    figures: list[Figure]
    details: dict[str, Any]


# -- command line -----------------------------------------------------------------------------
def parse_args(description: str, argv: Sequence[str] | None) -> RunSettings:
    parser = argparse.ArgumentParser(description=description)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller run, under a minute on CPU")
    size.add_argument("--smoke", action="store_true", help="tiny run for the test suite")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:n]")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--model-size",
        choices=["demo", "1b", "realistic"],
        default="demo",
        help="realistic: hidden 1024 on CPU, Llama-3-8B's shapes on CUDA (bench.models)",
    )
    parser.add_argument("--model-dir", type=Path, default=None, help="an existing HF folder")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    argv = tuple(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    cuda = args.device.startswith("cuda")
    return RunSettings(
        mode=mode,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        model_size=args.model_size,
        model_dir=args.model_dir,
        results_dir=args.results_dir,
        threads=args.threads or available_cores(),
        argv=argv,
    )


def configure(settings: RunSettings) -> None:
    """Pin torch's intra-op threads to the chosen count (recorded as machine.torch_threads) and
    keep transformers' progress bars off the benchmark's output."""
    torch.set_num_threads(settings.threads)
    transformers.utils.logging.disable_progress_bar()


# -- the machine ------------------------------------------------------------------------------
def machine_info(settings: RunSettings) -> dict[str, Any]:
    """The CPU, core and thread counts, library versions, and the GPU when running on CUDA."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if settings.is_cuda:
        import triton

        info["gpu"] = torch.cuda.get_device_name(torch.device(settings.device))
        info["triton"] = triton.__version__
    return info


def load_details(start: Sequence[float], end: Sequence[float]) -> dict[str, Any]:
    """The 1/5/15-minute load averages (`os.getloadavg()`) at a run's start and end, and whether
    the machine was busier than its cores during it (its figures then include others' work)."""
    return {
        "start": [round(x, 2) for x in start],
        "end": [round(x, 2) for x in end],
        "busy": max(start[0], end[0]) > available_cores(),
    }


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# -- timing -----------------------------------------------------------------------------------
def now(device: str) -> float:
    """A perf_counter reading taken after the device has finished its queued work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))
    return time.perf_counter()


class Stopwatch:
    """Wall-clock and process CPU seconds of a `with` block (device work included).

    On a shared machine wall time grows with other processes' load while CPU time mostly does
    not, so results record both; figures use wall time.
    """

    def __init__(self, device: str):
        self.device = device
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self._cpu = time.process_time()
        self._wall = now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = now(self.device) - self._wall
        self.cpu_seconds = time.process_time() - self._cpu


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# -- output -----------------------------------------------------------------------------------
def format_table(figures: Sequence[Figure]) -> str:
    rows = [("figure", "value", "unit", "goal", "met")]
    for f in figures:
        goal = f.as_dict()["goal"] or ""
        met = "" if f.met is None else ("yes" if f.met else "NO")
        rows.append((f.name, f"{f.value:,.3f}", f.unit, goal, met))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def result_path(benchmark: str, settings: RunSettings) -> Path:
    stem = benchmark
    if settings.is_cuda:
        stem += "-" + gpu_slug(torch.cuda.get_device_name(torch.device(settings.device)))
    if settings.model_size == "realistic":  # 1b is its benchmarks' only GPU size: no suffix
        stem += "-realistic"
    if settings.mode != "full":
        stem += "-" + settings.mode
    return settings.results_dir / f"{stem}.json"


def gpu_slug(device_name: str) -> str:
    """The GPU's model for file names: 'NVIDIA H100 80GB HBM3' → 'h100', 'NVIDIA A100-SXM4-80GB'
    → 'a100'; a name with no letters-and-digits model word is kept whole, slugged."""
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    model = next((w for w in words if re.fullmatch(r"[a-z]+[0-9]+[a-z]*", w)), None)
    return model or "-".join(w for w in words if w != "nvidia") or "gpu"


def write_result(result: Result) -> Path:
    """Write the result JSON (see the module docstring) and return its path."""
    settings = result.settings
    payload = {
        "benchmark": result.benchmark,
        "mode": settings.mode,
        "command": " ".join(["python", "-m", f"bench.{result.benchmark}", *settings.argv]),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(settings),
        "model": result.model,
        "workload": result.workload,
        "settings": result.engine_settings,
        "figures": [f.as_dict() for f in result.figures],
        "details": result.details,
    }
    path = result_path(result.benchmark, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class PreparedRun:
    settings: RunSettings
    workdir: Path
    """A temporary folder, removed when the run ends."""
    model_dir: Path
    model: dict[str, Any]
    """The result's description of the model."""


@contextlib.contextmanager
def prepared_run(description: str, argv: Sequence[str] | None) -> Iterator[PreparedRun]:
    """A benchmark's start: parse the command line, configure torch, and prepare the model (in
    the run's temporary folder unless one is given)."""
    settings = parse_args(description, argv)
    configure(settings)
    with tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp:
        model_dir, model = prepare_model(settings, Path(tmp))
        yield PreparedRun(settings, Path(tmp), model_dir, model)


def run_benchmark(
    description: str,
    argv: Sequence[str] | None,
    benchmark: Callable[[RunSettings, Path, dict[str, Any]], Result],
) -> Path:
    """A benchmark's `main`: parse the command line, configure torch, prepare the model (in a
    temporary folder unless given), run `benchmark(settings, model_dir, model_description)`,
    then print and write its result; returns the result file's path."""
    with prepared_run(description, argv) as run:
        result = benchmark(run.settings, run.model_dir, run.model)
    return report(result)


def report(result: Result) -> Path:
    """Print the table (the benchmark's output on stdout) and write the JSON."""
    path = write_result(result)
    print(format_table(result.figures))
    print(f"\nwritten to {path}")
    return path
