"""The stacked LoRA layout: slot writes place each adapter's pairs where the fused GEMMs expect them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.adapters.errors import RankOverLimit, ShapeMismatch
from loramux.adapters.layout import GROUPS, LoraStack, slice_offsets
from loramux.adapters.peft_format import AdapterLimits, LoraAdapter, load_peft_adapter
from tests.adapters.peft_adapters import make_peft_adapter, tiny_base, tiny_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(folder: Path, **lora_kwargs: object) -> LoraAdapter:
    return load_peft_adapter(make_peft_adapter(folder, **lora_kwargs), tiny_base())


def fused_lora_output(
    stack: LoraStack, layer: int, group: str, slot: int, x: torch.Tensor
) -> torch.Tensor:
    """What the engine's kernels compute for tokens x using `slot`, slice by slice."""
    stacked = stack[layer, group]
    outputs = []
    for index in range(len(GROUPS[group])):
        start, end = stacked.slice_offsets[index], stacked.slice_offsets[index + 1]
        shrunk = x @ stacked.lora_a[slot, index].T
        outputs.append(shrunk @ stacked.lora_b[slot, start:end].T)
    return torch.cat(outputs, dim=-1)


def expected_lora_output(
    lora: LoraAdapter, layer: int, group: str, x: torch.Tensor
) -> torch.Tensor:
    """The same from the adapter's own pairs: delta_W = b @ a, zero where not adapted."""
    base = tiny_base()
    outputs = []
    for proj in GROUPS[group]:
        weights = lora.modules.get((layer, proj))
        if weights is None:
            outputs.append(torch.zeros(x.shape[0], base.projection_shape(proj).out_features))
        else:
            outputs.append(x @ (weights.b @ weights.a).T)
    return torch.cat(outputs, dim=-1)


def test_slice_offsets_follow_the_fused_projections() -> None:
    base = tiny_base()
    assert slice_offsets(base, "qkv") == (0, 64, 96, 128)
    assert slice_offsets(base, "o") == (0, 64)
    assert slice_offsets(base, "gate_up") == (0, 96, 192)
    assert slice_offsets(base, "down") == (0, 64)


def test_allocate_shapes_dtypes_and_empty_slots() -> None:
    stack = LoraStack.allocate(
        tiny_base(), max_slots=3, max_rank=16, dtype=torch.bfloat16, device="cpu"
    )
    assert set(stack.groups) == {(layer, g) for layer in range(2) for g in GROUPS}
    qkv, down = stack[1, "qkv"], stack[0, "down"]
    assert qkv.lora_a.shape == (3, 3, 16, 64) and qkv.lora_b.shape == (3, 128, 16)
    assert down.lora_a.shape == (3, 1, 16, 96) and down.lora_b.shape == (3, 64, 16)
    assert qkv.lora_a.dtype == qkv.lora_b.dtype == torch.bfloat16
    assert qkv.ranks.dtype == torch.int32 and qkv.ranks.shape == (3, 3)
    assert not any(s.lora_a.any() or s.lora_b.any() or s.ranks.any() for s in stack.groups.values())
    assert (stack.max_slots, stack.max_rank) == (3, 16)


def test_write_slot_copies_pairs_zero_pads_and_sets_ranks(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    stack = LoraStack.allocate(
        tiny_base(), max_slots=2, max_rank=16, dtype=torch.float32, device="cpu"
    )
    stack.write_slot(1, lora)
    qkv = stack[0, "qkv"]
    q, v = lora.modules[0, "q"], lora.modules[0, "v"]
    assert qkv.ranks[1].tolist() == [8, 0, 8]
    assert torch.equal(qkv.lora_a[1, 0, :8], q.a) and torch.equal(qkv.lora_a[1, 2, :8], v.a)
    assert torch.equal(qkv.lora_b[1, 0:64, :8], q.b) and torch.equal(qkv.lora_b[1, 96:128, :8], v.b)
    assert not qkv.lora_a[1, :, 8:].any() and not qkv.lora_b[1, :, 8:].any()
    assert not qkv.lora_a[1, 1].any() and not qkv.lora_b[1, 64:96].any()
    assert stack[1, "down"].ranks[1].tolist() == [8]
    assert stack[1, "gate_up"].ranks[1].tolist() == [0, 0] and stack[1, "o"].ranks[1].tolist() == [
        0
    ]
    assert not any(s.lora_a[0].any() or s.ranks[0].any() for s in stack.groups.values())


@pytest.mark.parametrize("group", list(GROUPS))
def test_stacked_output_equals_the_adapters_delta(tmp_path: Path, group: str) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=["q_proj", "k_proj", "up_proj", "o_proj"])
    stack = LoraStack.allocate(
        tiny_base(), max_slots=4, max_rank=32, dtype=torch.float32, device="cpu"
    )
    stack.write_slot(2, lora)
    generator = torch.Generator().manual_seed(0)
    in_features = stack[0, group].lora_a.shape[-1]
    x = torch.randn(5, in_features, generator=generator)
    for layer in range(2):
        torch.testing.assert_close(
            fused_lora_output(stack, layer, group, 2, x),
            expected_lora_output(lora, layer, group, x),
        )


def test_write_replaces_the_previous_adapter_and_clear_empties(tmp_path: Path) -> None:
    everything = adapter(tmp_path / "all", r=16, lora_alpha=16, target_modules=ALL_SEVEN)
    q_only = adapter(tmp_path / "q", r=4, target_modules=["q_proj"], seed=1)
    stack = LoraStack.allocate(
        tiny_base(), max_slots=2, max_rank=16, dtype=torch.float32, device="cpu"
    )
    stack.write_slot(0, everything)
    stack.write_slot(1, everything)
    stack.write_slot(0, q_only)
    qkv = stack[1, "qkv"]
    assert qkv.ranks.tolist() == [[4, 0, 0], [16, 16, 16]]
    assert not qkv.lora_a[0, 0, 4:].any() and not qkv.lora_b[0, 64:].any()
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        fused_lora_output(stack, 1, "qkv", 0, x), expected_lora_output(q_only, 1, "qkv", x)
    )
    stack.clear_slot(0)
    assert not any(
        s.lora_a[0].any() or s.lora_b[0].any() or s.ranks[0].any() for s in stack.groups.values()
    )
    torch.testing.assert_close(
        fused_lora_output(stack, 0, "gate_up", 1, torch.ones(2, 64)),
        expected_lora_output(everything, 0, "gate_up", torch.ones(2, 64)),
    )


def test_write_casts_to_the_stack_dtype(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8)
    stack = LoraStack.allocate(
        tiny_base(), max_slots=1, max_rank=8, dtype=torch.float16, device="cpu"
    )
    stack.write_slot(0, lora)
    assert torch.equal(stack[0, "qkv"].lora_b[0, :64], lora.modules[0, "q"].b.half())


def test_refused_writes_change_nothing(tmp_path: Path) -> None:
    base = tiny_base()
    resident = adapter(tmp_path / "ok", r=8)
    too_wide = load_peft_adapter(
        make_peft_adapter(tmp_path / "wide", r=32, lora_alpha=32), base, AdapterLimits()
    )
    other_base = tiny_base(hidden_size=128, head_dim=32)
    foreign = load_peft_adapter(
        make_peft_adapter(tmp_path / "foreign", model=tiny_model(hidden_size=128, head_dim=32)),
        other_base,
    )
    stack = LoraStack.allocate(base, max_slots=2, max_rank=16, dtype=torch.float32, device="cpu")
    stack.write_slot(0, resident)
    before = {key: s.lora_a.clone() for key, s in stack.groups.items()}
    with pytest.raises(RankOverLimit):
        stack.write_slot(0, too_wide)
    with pytest.raises(ShapeMismatch):
        stack.write_slot(0, foreign)
    with pytest.raises(IndexError):
        stack.write_slot(2, resident)
    with pytest.raises(IndexError):
        stack.clear_slot(-1)
    assert all(torch.equal(before[key], s.lora_a) for key, s in stack.groups.items())
    assert stack[0, "qkv"].ranks[0].tolist() == [8, 0, 8]


@pytest.mark.gpu
def test_slots_on_a_cuda_device_match_the_cpu_layout(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=ALL_SEVEN)
    on_cpu = LoraStack.allocate(
        tiny_base(), max_slots=2, max_rank=16, dtype=torch.bfloat16, device="cpu"
    )
    on_gpu = LoraStack.allocate(
        tiny_base(), max_slots=2, max_rank=16, dtype=torch.bfloat16, device="cuda"
    )
    on_cpu.write_slot(1, lora)
    on_gpu.write_slot(1, lora)
    torch.cuda.synchronize()
    for key, stacked in on_gpu.groups.items():
        assert stacked.lora_a.device.type == "cuda" and stacked.ranks.device.type == "cuda"
        assert torch.equal(stacked.lora_a.cpu(), on_cpu[key].lora_a)
        assert torch.equal(stacked.lora_b.cpu(), on_cpu[key].lora_b)
        assert torch.equal(stacked.ranks.cpu(), on_cpu[key].ranks)
