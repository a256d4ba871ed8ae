"""The LoRA kernels' batch metadata (`kernels.lora_meta`): segments and per-token arrays, padded
in place for CUDA graphs, built on the host and copied to the device."""

from __future__ import annotations

import pytest
import torch

from loramux.kernels.lora_meta import NO_SLOT, LoraMetaBuffers
from tests.kernels.lora_problems import needs_cuda


def test_meta_buffers_build_both_layouts() -> None:
    """The worked example of kernels.lora_meta: slots a=3, b=7, tokens [a a a - b b a]."""
    buffers = LoraMetaBuffers(max_tokens=16, device=torch.device("cpu"))
    meta = buffers.build([3, 3, 3, None, 7, 7, 3])
    assert (meta.num_segments, meta.num_adapter_tokens) == (3, 6)
    got = [t.tolist() for t in (meta.seg_starts, meta.seg_lens, meta.seg_slots)]
    assert got == [[0, 4, 6], [3, 2, 1], [3, 7, 3]]
    assert meta.token_indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert meta.token_slots.tolist() == [3, 3, 3, 7, 7, 3]
    assert all(t.dtype == torch.int32 for t in (meta.seg_starts, meta.token_slots))
    assert buffers.build([None, None]).num_segments == 0
    with pytest.raises(ValueError, match="capacity"):
        buffers.build([0] * 17)


@pytest.mark.gpu
@needs_cuda
def test_meta_buffers_copy_to_the_device() -> None:
    slots = [1, 1, None, 0, 2, 2, 2, None]
    on_gpu = LoraMetaBuffers(8, torch.device("cuda")).build(slots)
    on_cpu = LoraMetaBuffers(8, torch.device("cpu")).build(slots)
    for field in ("seg_starts", "seg_lens", "seg_slots", "token_indices", "token_slots"):
        gpu_values = getattr(on_gpu, field)
        assert gpu_values.is_cuda
        assert gpu_values.tolist() == getattr(on_cpu, field).tolist()


def test_the_padded_layout_keeps_its_per_token_arrays_in_place() -> None:
    buffers = LoraMetaBuffers(max_tokens=16, device=torch.device("cpu"))
    meta = buffers.build([3, 3, 3, None, 7, 7, 3], pad_to=8)
    assert meta.token_indices.tolist() == list(range(8))
    assert meta.token_slots.tolist() == [3, 3, 3, NO_SLOT, 7, 7, 3, NO_SLOT]
    assert [t.tolist() for t in (meta.seg_starts, meta.seg_lens)] == [[0, 4, 6], [3, 2, 1]]
    again = buffers.build([None, 5], pad_to=8)
    assert again.token_slots.data_ptr() == meta.token_slots.data_ptr()
    assert again.token_indices.data_ptr() == meta.token_indices.data_ptr()
    assert again.token_slots.tolist() == [NO_SLOT, 5, *[NO_SLOT] * 6]
