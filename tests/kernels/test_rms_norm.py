"""RMSNorm with the residual add fused: the torch twin is transformers' LlamaRMSNorm after the
decoder layer's add, bit for bit, and the Triton kernel (interpreted on CPU, compiled on CUDA)
equals the twin: the sum exactly, the normalized rows within one rounding to the dtype."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from loramux.kernels.rms_norm import rms_norm, rms_norm_torch, rms_norm_triton

EPS = 1e-5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of an O(1) value to the dtype (the sum of squares is taken in another order).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(
    rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * 3
    residual = torch.randn(rows, hidden, generator=g)
    weight = 1 + torch.randn(hidden, generator=g) / 4
    return tuple(t.to(device=device, dtype=dtype) for t in (x, residual, weight))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_twin_is_transformers_rms_norm_after_the_residual_add(dtype: torch.dtype) -> None:
    x, residual, weight = _inputs(5, 96, dtype)
    reference = LlamaRMSNorm(96, eps=EPS).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(weight)
        normed, total = rms_norm_torch(x, weight, EPS, residual)
        assert total is not None and torch.equal(total, residual + x)
        assert torch.equal(normed, reference(residual + x))
        alone, none = rms_norm_torch(x, weight, EPS)
        assert none is None and torch.equal(alone, reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 96), (33, 256), (3, 1000)])
def test_the_kernel_equals_the_twin(dtype: torch.dtype, rows: int, hidden: int) -> None:
    x, residual, weight = _inputs(rows, hidden, dtype, seed=rows)
    for given in (residual, None):
        normed, total = rms_norm_triton(x, weight, EPS, given)
        want, want_total = rms_norm_torch(x, weight, EPS, given)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(normed, want, rtol=tol, atol=tol)
        if given is None:
            assert total is None
        elif dtype == torch.bfloat16 and not x.is_cuda:
            # The interpreter rounds fp32 to bf16 toward zero (the GPU to nearest, as torch):
            # exact on CUDA (the gpu test below), within one bf16 step here.
            assert total is not None and want_total is not None
            torch.testing.assert_close(total, want_total, rtol=2**-7, atol=0)
        else:
            assert total is not None and want_total is not None
            assert torch.equal(total, want_total), "the sum is rounded once, as torch does"


def test_rows_of_a_wider_tensor_and_an_empty_step() -> None:
    wide, residual, weight = _inputs(6, 160, torch.float32)
    x = wide[:, :128]  # rows 160 apart
    normed, total = rms_norm_triton(x, weight[:128].contiguous(), EPS, residual[:, 32:160])
    want, want_total = rms_norm_torch(x, weight[:128], EPS, residual[:, 32:160])
    torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
    assert total is not None and torch.equal(total, want_total)
    empty, none = rms_norm_triton(x[:0], weight[:128].contiguous(), EPS)
    assert empty.shape == (0, 128) and none is None


def test_cpu_tensors_take_the_twin() -> None:
    x, residual, weight = _inputs(4, 64, torch.float32)
    got, got_total = rms_norm(x, weight, EPS, residual)
    want, want_total = rms_norm_torch(x, weight, EPS, residual)
    assert torch.equal(got, want) and torch.equal(got_total, want_total)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 64, 256, 4096])
def test_compiled_kernel_on_cuda_equals_the_twin_at_serving_sizes(
    dtype: torch.dtype, rows: int
) -> None:
    x, residual, weight = _inputs(rows, 4096, dtype, device="cuda", seed=rows)
    normed, total = rms_norm(x, weight, EPS, residual)
    want, want_total = rms_norm_torch(x, weight, EPS, residual)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(normed, want, rtol=tol, atol=tol)
    assert torch.equal(total, want_total)  # type: ignore[arg-type]
