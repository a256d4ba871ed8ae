"""RMSNorm with the residual add fused in: one Triton kernel on CUDA where the torch form launches
nine (the add, then upcast, square, mean, add eps, rsqrt, multiply, downcast and weight). On an
H100 these small kernels were a quarter of a Llama-3-8B decode step at batch 64
(docs/gpu-runs.md).

Numerics are transformers' LlamaRMSNorm after its decoder layer's residual add, each rounding in
the same place: h = x + residual rounded to the dtype; in fp32, h * rsqrt(mean(h²) + eps),
rounded to the dtype; times the weight, rounded to the dtype. The kernel differs from its torch
twin (`rms_norm_torch`) only in the order its sum of squares is taken; the CPU runs the twin, so
CPU outputs stay bit-identical to transformers'.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program: one row. sum = x + residual (when HAS_RESIDUAL), out = weight * norm(sum)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = (hf * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(h), h) with h = x + residual, or (weight * norm(x), None) without a
    residual; x, residual [T, H] rows contiguous, weight [H], all of one dtype."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],)
    assert weight.dtype == x.dtype and weight.is_contiguous()
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        total = torch.empty_like(x)
    if x.shape[0] == 0:
        return out, total
    block = triton.next_power_of_2(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, out, out if total is None else total,
        x.stride(0), x.stride(0) if residual is None else residual.stride(0), out.stride(0),
        out.stride(0) if total is None else total.stride(0),
        x.shape[1], eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, total


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The twin, in transformers' own operations (the CPU path, and the reference)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype), residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel on CUDA tensors of one dtype, the twin otherwise; same semantics."""
    if x.is_cuda and weight.dtype == x.dtype and x.dim() == 2:
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_torch(x, weight, eps, residual)
