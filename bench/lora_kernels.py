"""Multi-LoRA kernel time on a GPU, and what serving every request on an adapter adds to a step.

1. Kernels. One projection of H inputs and H outputs; S adapters in device slots of the engine's
   layout (adapters.layout: slots sized for rank `slot_rank`), every adapter at rank r:
   - decode: one token per adapter, 64 adapters: BGMV shrink + expand;
   - prefill: 8 adapters x 128 tokens: SGMV shrink + expand.
   Timed with CUDA events (warm-up, then the median of `iters` calls; the call includes zeroing
   the fp32 intermediate, as the engine does) against a torch loop over the adapters in the same
   dtype (`y[rows] += (x[rows] @ A[:r].T) @ B[:, :r].T`) and against the memory-bandwidth bound:
   the bytes the pair must move at least (x; each adapter's A and B up to rank r; the fp32
   intermediate written and read back; y read and written) over the bandwidth of a large
   device-to-device copy (bytes read + written per second). The kernels' output is compared
   with the loop's (`details`).
2. LoRA overhead. The engine's decode step on a ~1.1B Llama-shaped random model
   (bench.models.llama_1b_config) at several batch sizes: every request on an adapter (ranks
   8/16/32/64 round-robin, all seven projections) against every request on the base model.
   Median time of `steps` decode steps once every request has its first token and a few steps
   more have passed. Goal: LoRA adds under 10%, reported as base / LoRA step time >= 1/1.1.

Needs CUDA: without it, this prints so and exits 0, unless `--interpret-smoke`, which runs tiny
shapes on the CPU, the kernels under the Triton interpreter, and part 2 on the demo model, to
show that the code runs. (With CUDA, `--interpret-smoke` runs the same tiny shapes on the GPU.)

Run: `python -m bench.lora_kernels [--quick]`; `python -m bench.lora_kernels --interpret-smoke`.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before any kernel module is imported: Triton reads the flag when it decorates a kernel,
    # which then runs on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    RESULTS_DIR,
    Figure,
    Result,
    RunSettings,
    available_cores,
    configure,
    median,
    report,
)
from bench.decode_steps import copy_bandwidth
from bench.lora_overhead import measure_overhead, overhead_config
from bench.models import prepare_model
from loramux.kernels.lora_expand import bgmv_expand, sgmv_expand
from loramux.kernels.lora_meta import INTERPRET, LoraBatchMeta, LoraMetaBuffers
from loramux.kernels.lora_shrink import bgmv_shrink, sgmv_shrink

NAME = "lora_kernels"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
OVERHEAD_GOAL = 1 / 1.1
"""base / LoRA step time at which LoRA adds exactly 10%."""


@dataclass(frozen=True)
class Workload:
    hidden: int
    slot_rank: int
    ranks: tuple[int, ...]
    dtypes: tuple[str, ...]
    decode: tuple[int, int]
    """Adapters, tokens per adapter."""
    prefill: tuple[int, int]
    warmup: int
    iters: int
    copy_bytes: int
    batch_sizes: tuple[int, ...]
    """Part 2: running requests per decode step."""
    prompt_len: int
    steps: int
    num_adapters: int
    """Part 2: adapters the requests are spread over, ranks cycling 8/16/32/64."""


WORKLOADS = {
    "full": Workload(
        4096, 64, (8, 16, 32, 64), ("float16", "bfloat16"), (64, 1), (8, 128), 10, 100, 1 << 30,
        (1, 4, 16, 64, 256), 128, 20, 8,
    ),
    "quick": Workload(
        4096, 64, (16, 64), ("bfloat16",), (64, 1), (8, 128), 5, 30, 1 << 28, (1, 16, 64), 128, 10, 8
    ),
    "smoke": Workload(64, 32, (16,), ("bfloat16",), (4, 1), (2, 16), 1, 2, 1 << 20, (1, 2), 8, 2, 2),
}  # fmt: skip


# -- timing -----------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` after `warmup` calls: CUDA events around each call on a GPU
    (device time), perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return median(times)
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        events.append((begin, end))
    torch.cuda.synchronize()
    return median([begin.elapsed_time(end) for begin, end in events])


# -- part 1: kernels --------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelCase:
    kind: str
    """'decode' (BGMV) or 'prefill' (SGMV)."""
    adapters: int
    tokens_per_adapter: int
    rank: int
    dtype: str

    @property
    def name(self) -> str:
        shape = f"{self.adapters}x{self.tokens_per_adapter}"
        return f"{self.kind} {shape} r{self.rank} {self.dtype}"

    @property
    def tokens(self) -> int:
        return self.adapters * self.tokens_per_adapter

    def min_bytes(self, hidden: int) -> int:
        """What shrink + expand must move at least (see the module docstring)."""
        e = DTYPES[self.dtype].itemsize
        weights = 2 * self.adapters * self.rank * hidden * e
        activations = 3 * self.tokens * hidden * e + 2 * self.tokens * self.rank * 4
        return weights + activations


@dataclass(frozen=True)
class KernelInputs:
    """One case's tensors in the engine's pool layout: slot s's A [r, H] then B [H, r] packed
    from element 2 r H s of the pool, ranks [S, 1] (every slot at the case's rank), t sized for
    the workload's slot rank; token i uses slot i // tokens_per_adapter."""

    x: torch.Tensor
    pool: torch.Tensor
    a_offsets: torch.Tensor
    b_offsets: torch.Tensor
    ranks: torch.Tensor
    meta: LoraBatchMeta
    max_rank: int

    def pair(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s (A, B) as views of the pool."""
        r, h = int(self.ranks[slot, 0]), self.x.shape[1]
        a, b = int(self.a_offsets[slot, 0]), int(self.b_offsets[slot, 0])
        return self.pool[a : a + r * h].view(r, h), self.pool[b : b + h * r].view(h, r)

    @classmethod
    def make(cls, case: KernelCase, w: Workload, device: str) -> KernelInputs:
        dtype, h, r = DTYPES[case.dtype], w.hidden, case.rank
        gen = torch.Generator(device).manual_seed(0)
        lora_a = torch.randn(case.adapters, r, h, generator=gen, device=device) / h**0.5
        lora_b = torch.randn(case.adapters, h, r, generator=gen, device=device) / r**0.5
        pool = torch.cat([lora_a.flatten(1), lora_b.flatten(1)], dim=1).flatten().to(dtype)
        a_offsets = torch.arange(case.adapters, device=device)[:, None] * (2 * r * h)
        x = torch.randn(case.tokens, h, generator=gen, device=device).to(dtype)
        ranks = torch.full((case.adapters, 1), r, dtype=torch.int32, device=device)
        slots = [i // case.tokens_per_adapter for i in range(case.tokens)]
        meta = LoraMetaBuffers(case.tokens, torch.device(device)).build(slots)
        return cls(x, pool, a_offsets, a_offsets + r * h, ranks, meta, w.slot_rank)


def kernel_call(inp: KernelInputs, per_token: bool, y: torch.Tensor) -> Callable[[], None]:
    """Shrink then expand into y, as the engine's LoraBatch.apply does for one group."""
    x, pool, a_offs, b_offs = inp.x, inp.pool, inp.a_offsets, inp.b_offsets
    ranks, m = inp.ranks, inp.meta
    offsets = (0, x.shape[1])

    def call() -> None:
        t = torch.zeros(1, x.shape[0], inp.max_rank, dtype=torch.float32, device=x.device)
        if per_token:
            bgmv_shrink(x, pool, a_offs, ranks, m.token_indices, m.token_slots, t)
            bgmv_expand(t, pool, b_offs, offsets, ranks, m.token_indices, m.token_slots, y)
        else:
            sgmv_shrink(x, pool, a_offs, ranks, m.seg_starts, m.seg_lens, m.seg_slots, t)
            sgmv_expand(t, pool, b_offs, offsets, ranks, m.seg_starts, m.seg_lens, m.seg_slots, y)

    return call


def loop_call(inp: KernelInputs, case: KernelCase, y: torch.Tensor) -> Callable[[], None]:
    """The plain torch way: one pair of matmuls per adapter, in the inputs' dtype."""
    n = case.tokens_per_adapter
    pairs = [inp.pair(s) for s in range(case.adapters)]

    def call() -> None:
        for s, (a, b) in enumerate(pairs):
            rows = slice(s * n, (s + 1) * n)
            y[rows] += (inp.x[rows] @ a.T) @ b.T

    return call


def measure_kernel(case: KernelCase, w: Workload, device: str, bandwidth: float) -> dict[str, Any]:
    """Times (ms) of the kernels, the loop and the bandwidth bound, and how far apart their
    results are after one call each on zeroed outputs."""
    inp = KernelInputs.make(case, w, device)
    per_token = case.kind == "decode"
    y_kernel, y_loop = torch.zeros_like(inp.x), torch.zeros_like(inp.x)
    kernel_call(inp, per_token, y_kernel)()
    loop_call(inp, case, y_loop)()
    checked = {
        "max_abs_diff_vs_loop": (y_kernel.float() - y_loop.float()).abs().max().item(),
        "max_abs_output": y_loop.float().abs().max().item(),
    }
    return {
        "kernel_ms": time_ms(kernel_call(inp, per_token, y_kernel), device, w.warmup, w.iters),
        "torch_loop_ms": time_ms(loop_call(inp, case, y_loop), device, w.warmup, w.iters),
        "bound_ms": case.min_bytes(w.hidden) / bandwidth * 1e3,
        "min_bytes": case.min_bytes(w.hidden),
        **checked,
    }


def kernel_cases(w: Workload) -> list[KernelCase]:
    shapes = (("decode", *w.decode), ("prefill", *w.prefill))
    return [
        KernelCase(kind, adapters, per, rank, dtype)
        for dtype in w.dtypes
        for kind, adapters, per in shapes
        for rank in w.ranks
    ]


# -- the benchmark ----------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> RunSettings | None:
    """The run's settings; None when there is nothing to run here (no CUDA, no smoke asked)."""
    parser = argparse.ArgumentParser(description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer ranks, dtypes and batch sizes")
    size.add_argument(
        "--interpret-smoke", action="store_true", help="tiny shapes (CPU: interpreted)"
    )
    parser.add_argument("--device", default="cuda", help="a CUDA device")
    parser.add_argument(
        "--dtype", choices=["float16", "bfloat16"], default="bfloat16", help="part 2"
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="part 2: an existing HF folder"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    given = tuple(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    cuda = torch.cuda.is_available()
    if not (cuda or args.interpret_smoke):
        print("lora_kernels times Triton kernels and needs a CUDA device; none is present.")
        print("`python -m bench.lora_kernels --interpret-smoke` runs tiny shapes interpreted.")
        return None
    if not cuda and not INTERPRET:
        raise SystemExit("the kernels were imported before TRITON_INTERPRET=1 was set")
    smoke = args.interpret_smoke
    return RunSettings(
        mode="smoke" if smoke else "quick" if args.quick else "full",
        device=args.device if cuda else "cpu",
        dtype=args.dtype if cuda else "float32",
        model_size="demo" if smoke else "1b",
        model_dir=args.model_dir,
        results_dir=args.results_dir,
        threads=args.threads or available_cores(),
        argv=given,
    )


def figures(
    bandwidth: float, kernels: dict[KernelCase, dict[str, Any]], steps: dict[int, dict[str, float]]
) -> list[Figure]:
    out = [Figure("device-to-device copy bandwidth", bandwidth / 1e9, "GB/s")]
    for case, k in kernels.items():
        out += [
            Figure(f"{case.name}: shrink+expand kernels", k["kernel_ms"] * 1e3, "us"),
            Figure(f"{case.name}: torch loop / kernels", k["torch_loop_ms"] / k["kernel_ms"], "x"),
            Figure(
                f"{case.name}: bandwidth bound / kernels", k["bound_ms"] / k["kernel_ms"], "ratio"
            ),
        ]
    out += [
        Figure(
            f"decode step base / LoRA, batch {b}",
            s["base_ms"] / s["lora_ms"],
            "ratio",
            OVERHEAD_GOAL,
        )
        for b, s in steps.items()
    ]
    return out


def main(argv: Sequence[str] | None = None) -> Path | None:
    settings = parse_args(argv)
    if settings is None:
        return None
    configure(settings)
    w = WORKLOADS[settings.mode]
    bandwidth = copy_bandwidth(w.copy_bytes, settings.device, w.iters)
    kernels = {c: measure_kernel(c, w, settings.device, bandwidth) for c in kernel_cases(w)}
    with tempfile.TemporaryDirectory(prefix="loramux-bench-") as tmp:
        model_dir, model = prepare_model(settings, Path(tmp))
        steps = measure_overhead(settings, model_dir, Path(tmp) / "adapters", w)
    details = {
        "copy_bandwidth_bytes_per_s": bandwidth,
        "kernels": [asdict(c) | {"name": c.name} | k for c, k in kernels.items()],
        "decode_steps": [
            {"batch": b, **s, "lora_overhead": s["lora_ms"] / s["base_ms"] - 1}
            for b, s in steps.items()
        ],
        "interpreted": INTERPRET,
    }
    workload = asdict(w) | {
        "kernel_layout": "one projection H -> H; slots of rank slot_rank, every adapter at rank r",
        "adapters": "part 2: written by bench.lora_overhead.write_adapter, all seven projections",
        "goal": "part 2: LoRA adds under 10% to the decode step (base / LoRA >= 1/1.1)",
    }
    config = asdict(overhead_config(settings, Path(), w))
    config.pop("model")
    return report(
        Result(NAME, settings, model, workload, config, figures(bandwidth, kernels, steps), details)
    )


if __name__ == "__main__":
    main()
