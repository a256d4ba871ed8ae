"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU: the compiler's
front end, its lowering and ptxas (bundled with triton) all run, so a kernel the interpreter
accepts but the GPU compiler rejects fails here, in CI, rather than on a lent GPU.

Run in a process without TRITON_INTERPRET (kernels decorated under the interpreter cannot be
compiled): `python -m tests.kernels.compile_for_gpu` prints one line per compiled variant and
exits 1 on the first failure. tests/kernels/test_compile_for_gpu.py runs it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loramux.kernels import lora_expand, lora_shrink, paged_attention, rms_norm, rope_cache
from loramux.kernels.lora_meta import segments_pad

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = ("bf16", "fp16", "fp32")
INDEX_POINTERS = {
    "ranks_ptr": "*i32",
    "offsets_ptr": "*i32",
    "a_offsets_ptr": "*i64",
    "b_offsets_ptr": "*i64",
    "scale_offsets_ptr": "*i64",
    "seg_starts_ptr": "*i32",
    "seg_lens_ptr": "*i32",
    "seg_slots_ptr": "*i32",
    "token_indices_ptr": "*i32",
    "token_slots_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "cu_seqlens_q_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "positions_ptr": "*i64",
    "slots_ptr": "*i64",
}
FLOATS = {"eps", "scale_log2e"}
FP32_POINTERS = {"t_ptr"}
"""The LoRA intermediate is float32 whatever the model's dtype."""


def compile_kernel(
    kernel: Any, dtype: str, constexprs: dict[str, Any], num_warps: int = 4, num_stages: int = 2
) -> None:
    """Compile `kernel` (a triton.jit function) with data pointers of `dtype`; the other
    arguments' types follow their names. Every `tl.constexpr` parameter must be given (one left
    out would be compiled as a runtime integer, not as the engine launches it)."""
    missing = {p.name for p in kernel.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"{kernel.__name__}: no value for constexpr {sorted(missing)}"
    signature: dict[str, str] = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INDEX_POINTERS:
            signature[name] = INDEX_POINTERS[name]
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    fixed = {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed)
    triton.compile(
        source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}
    )


def variants() -> list[tuple[str, Callable[[], None]]]:
    """(name, compile) for each kernel at the engine's serving shapes (Llama-3-8B: hidden 4096,
    32 query and 8 KV heads of 128, gate|up 2 x 14336), in each dtype."""
    out: list[tuple[str, Callable[[], None]]] = []

    def add(name: str, kernel: Any, dtype: str, constexprs: dict[str, Any], **options: int) -> None:
        out.append(
            (f"{name}[{dtype}]", lambda: compile_kernel(kernel, dtype, constexprs, **options))
        )

    for dtype in DTYPES:
        for residual in (True, False):
            add(
                f"rms_norm residual={residual}",
                rms_norm._rms_norm_kernel,
                dtype,
                {"HAS_RESIDUAL": residual, "BLOCK": 4096},
                num_warps=8,
            )
        add(
            "rope_cache",
            rope_cache._rope_cache_kernel,
            dtype,
            {"NUM_Q": 32, "NUM_KV": 8, "HALF": 64, "BLOCK_Q": 32, "BLOCK_KV": 8, "BLOCK_D": 64},
        )
        for max_q_len in (1, 512):
            tiles = paged_attention._choose_tiles(4, 128, max_q_len)
            add(
                f"paged_attention max_q_len={max_q_len}",
                paged_attention._paged_attention_kernel,
                dtype,
                {
                    "HEAD_DIM": 128, "GROUP": 4, "BLOCK_SIZE": 16, "GROUP_P": tiles.group_p,
                    "BLOCK_Q": tiles.block_q, "BLOCK_N": tiles.block_n, "BLOCK_D": tiles.block_d,
                    "INTERPRET": False,
                },
            )  # fmt: skip
        for rank in (16, 64):
            for scale in (False, True):
                e = lora_expand.bgmv_expand_tiles(64, 2 * 14336, rank)
                add(
                    f"bgmv_expand rank={rank} dora={scale}",
                    lora_expand._bgmv_expand_kernel,
                    dtype,
                    {"BLOCK_M": e.block_m, "BLOCK_N": e.block_n, "BLOCK_K": e.block_k,
                     "HAS_SCALE": scale, "DOT_F32": False},
                )  # fmt: skip
                e = lora_expand.sgmv_expand_tiles(512, 8, 14336, rank)
                add(
                    f"sgmv_expand rank={rank} dora={scale}",
                    lora_expand._sgmv_expand_kernel,
                    dtype,
                    {"BLOCK_M": e.block_m, "BLOCK_N": e.block_n, "BLOCK_K": e.block_k,
                     "SEGS_PAD": segments_pad(8), "DOT_F32": False, "HAS_SCALE": scale},
                )  # fmt: skip
            s = lora_shrink.bgmv_shrink_tiles(64, 4096, rank, 2)
            add(
                f"bgmv_shrink rank={rank}",
                lora_shrink._bgmv_shrink_kernel,
                dtype,
                {"BLOCK_M": s.block_m, "BLOCK_N": s.block_n, "BLOCK_K": s.block_k,
                 "SPLIT_K": s.split_k, "DOT_F32": False},
            )  # fmt: skip
            s = lora_shrink.sgmv_shrink_tiles(512, 8, 4096, rank, 2)
            add(
                f"sgmv_shrink rank={rank}",
                lora_shrink._sgmv_shrink_kernel,
                dtype,
                {"BLOCK_M": s.block_m, "BLOCK_N": s.block_n, "BLOCK_K": s.block_k,
                 "SPLIT_K": s.split_k, "SEGS_PAD": segments_pad(8), "DOT_F32": False},
            )  # fmt: skip
    return out


@triton.jit
def _rejected_by_the_compiler(x_ptr, out_ptr):
    """The interpreter runs it; the GPU compiler refuses a tl.dot under 16 rows."""
    offs = tl.arange(0, 8)
    x = tl.load(x_ptr + offs[:, None] * 8 + offs[None, :])
    tl.store(out_ptr + offs[:, None] * 8 + offs[None, :], tl.dot(x, x))


def main(argv: list[str]) -> int:
    if argv == ["--must-fail"]:  # the check itself can fail: a kernel the compiler refuses
        try:
            compile_kernel(_rejected_by_the_compiler, "fp16", {})
        except Exception as exc:
            print(f"refused as expected: {type(exc).__name__}", flush=True)
            return 1
        return 0
    for name, build in variants():
        try:
            build()
        except Exception as exc:
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)
            return 1
        print(f"compiled {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
