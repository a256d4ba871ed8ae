"""What every benchmark shares: the command line, the model it runs, the machine it ran on,
timing, the printed table and the JSON result file.

A result file is one JSON object:
    benchmark, mode ("full" | "quick" | "smoke"), command, created (UTC, ISO 8601),
    machine {cpu, cores, torch_threads, load_average (1/5/15 min, when written), platform, python,
             torch, transformers, [gpu, triton]},
    model {name, dtype, device, architecture sizes, parameters},
    workload {...}, settings {...},
    figures [{name, value, unit, goal, met}],   goal: ">= x", "<= x" or null; met: bool or null
    details {...}
Full runs write `bench/results/<name>.json` (`<name>-<gpu>.json` on CUDA); quick and smoke runs
add `-quick` / `-smoke` to the stem, so they never overwrite a full result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.demo_model import END_OF_TEXT_ID, EOS_TOKEN_IDS, LOGIT_STD, build_demo_model
from gateway.settings import EngineSettings

RESULTS_DIR = Path(__file__).parent / "results"

# Files of the demo model's folder reused as the 1B model's tokenizer and generation config.
_SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_GENERATION_CONFIG = "generation_config.json"


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
    parser.add_argument("--model-size", choices=["demo", "1b"], default="demo")
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


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# -- models -----------------------------------------------------------------------------------
def prepare_model(settings: RunSettings, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model folder to benchmark (built in `workdir` unless given) and its description."""
    if settings.model_dir is not None:
        path, name = settings.model_dir, str(settings.model_dir)
    elif settings.model_size == "demo":
        path, name = build_demo_model(workdir / "demo"), "demo (engine.demo_model, seed 0)"
    else:
        demo = build_demo_model(workdir / "demo")
        path = build_random_llama(workdir / "llama-1b", demo, settings.device)
        name = "llama-1b-random (bench.common.llama_1b_config, seed 0)"
    return path, describe_model(path, name, settings.dtype, settings.device)


def describe_model(folder: Path, name: str, dtype: str, device: str) -> dict[str, Any]:
    """A result's `model`: its name, dtype, device, architecture sizes and parameter count."""
    config = LlamaConfig.from_pretrained(folder)
    return {
        "name": name,
        "dtype": dtype,
        "device": device,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "parameters": _parameter_count(config),
    }


def _parameter_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def llama_1b_config() -> LlamaConfig:
    """The GPU variant's model: Llama-shaped, ~1.1B parameters (hidden 2048, 16 layers,
    32 query / 8 KV heads of 64, SwiGLU 8192, vocab 32000); its EOS and padding are the demo's."""
    return _llama_config(2048, 8192, 16, 32, 8, 64, 32000, 4096, 10000.0)


def llama3_8b_config() -> LlamaConfig:
    """Llama-3-8B's shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, SwiGLU
    14336, vocab 128256, rope theta 500000); its EOS and padding are the demo tokenizer's."""
    return _llama_config(4096, 14336, 32, 32, 8, 128, 128256, 8192, 500000.0)


def _llama_config(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    max_positions: int,
    rope_theta: float,
) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=END_OF_TEXT_ID,
        dtype="bfloat16",
    )


def shapes_only_folder(config: LlamaConfig, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A model folder with config.json and the demo tokenizer but no weights: the engine gives
    it seeded random ones (`EngineConfig.random_weights`). Ids past the tokenizer's vocabulary
    decode to nothing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


def _copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    """The demo model's tokenizer files and generation config."""
    for file in (*_SHARED_FILES, _GENERATION_CONFIG):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out_dir / file)


def build_random_llama(out_dir: Path, tokenizer_dir: Path, device: str, seed: int = 0) -> Path:
    """`llama_1b_config()` with seeded random bfloat16 weights, in HF layout.

    Scaled like the demo model (embeddings N(0, 1), projections N(0, 1/fan_in), norms 1,
    lm_head std LOGIT_STD / sqrt(hidden)) so activations stay O(1) and greedy decoding has
    clear margins between the top two logits (see engine.demo_model). Weights are drawn on `device` (fast on a GPU); the tokenizer and generation
    config are the demo model's.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_1b_config()
    config.save_pretrained(out_dir)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / math.sqrt(shape[1])
        if name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(config.hidden_size)
        drawn = torch.randn(shape, generator=generator, device=device) * std
        weights[name] = drawn.to(torch.bfloat16).cpu()
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    _copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


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


def run_benchmark(
    description: str,
    argv: Sequence[str] | None,
    benchmark: Callable[[RunSettings, Path, dict[str, Any]], Result],
) -> Path:
    """A benchmark's `main`: parse the command line, configure torch, prepare the model (in a
    temporary folder unless given), run `benchmark(settings, model_dir, model_description)`,
    then print and write its result; returns the result file's path."""
    settings = parse_args(description, argv)
    configure(settings)
    with tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp:
        model_dir, model = prepare_model(settings, Path(tmp))
        result = benchmark(settings, model_dir, model)
    return report(result)


def report(result: Result) -> Path:
    """Print the table (the benchmark's output on stdout) and write the JSON."""
    path = write_result(result)
    print(format_table(result.figures))
    print(f"\nwritten to {path}")
    return path
