"""The adapter pool layout: slot writes place each adapter's pairs, at its own ranks, where the
fused GEMMs expect them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.adapters.errors import RankOverLimit, ShapeMismatch
from loramux.adapters.layout import GROUPS, LoraStack, slice_offsets
from loramux.adapters.peft_format import AdapterLimits, LoraAdapter, load_peft_adapter
from tests.adapters.peft_adapters import HfBaseWeights, make_peft_adapter, tiny_base, tiny_model

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
        if stacked.ranks[slot, index]:
            shrunk = x @ stacked.a_of(slot, index).T
            outputs.append(shrunk @ stacked.b_of(slot, index).T)
        else:
            outputs.append(torch.zeros(x.shape[0], end - start))
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


def pooled(max_slots: int, max_rank: int, dtype: torch.dtype = torch.float32) -> LoraStack:
    """A stack whose pool holds `max_slots` adapters of `max_rank` on every projection."""
    elements = max_slots * LoraStack.full_rank_elements(tiny_base(), max_rank)
    return LoraStack.allocate(tiny_base(), max_slots, max_rank, elements, dtype, "cpu")


def test_allocate_shapes_dtypes_and_empty_slots() -> None:
    stack = pooled(max_slots=3, max_rank=16, dtype=torch.bfloat16)
    assert set(stack.groups) == {(layer, g) for layer in range(2) for g in GROUPS}
    qkv, down = stack[1, "qkv"], stack[0, "down"]
    assert qkv.a_offsets.shape == qkv.b_offsets.shape == qkv.ranks.shape == (3, 3)
    assert down.ranks.shape == (3, 1) and (qkv.in_features, down.in_features) == (64, 96)
    assert qkv.a_offsets.dtype == torch.int64 and qkv.ranks.dtype == torch.int32
    assert stack.pool.dtype == torch.bfloat16 and qkv.pool is stack.pool
    # per layer: q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+96 each, down 96+64; 2 layers
    assert stack.pool_elements == 3 * 16 * 2 * (128 + 96 + 96 + 128 + 160 + 160 + 160)
    assert not any(s.ranks.any() for s in stack.groups.values())
    assert (stack.max_slots, stack.max_rank) == (3, 16)


def test_an_adapter_takes_pool_memory_at_its_own_ranks(tmp_path: Path) -> None:
    small = adapter(tmp_path / "s", r=4, target_modules=["q_proj", "down_proj"])
    large = adapter(tmp_path / "l", r=16, target_modules=["q_proj", "down_proj"])
    assert LoraStack.region_elements(small) == 2 * 4 * (128 + 160)
    assert LoraStack.region_elements(large) == 4 * LoraStack.region_elements(small)
    stack = pooled(max_slots=2, max_rank=16)
    end = LoraStack.region_elements(small)
    stack.write_slot(1, small, 0)
    stack.write_slot(0, large, end)
    qkv = stack[0, "qkv"]
    assert qkv.a_offsets[1, 0] == 0 and qkv.b_offsets[1, 0] == 4 * 64
    assert qkv.a_offsets[0, 0] == end
    x = torch.randn(3, 64)
    for slot, lora in ((1, small), (0, large)):
        torch.testing.assert_close(
            fused_lora_output(stack, 1, "qkv", slot, x), expected_lora_output(lora, 1, "qkv", x)
        )


def test_write_slot_copies_pairs_zero_pads_and_sets_ranks(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    stack = pooled(max_slots=2, max_rank=16)
    stack.write_slot(1, lora, 7)
    qkv = stack[0, "qkv"]
    q, v = lora.modules[0, "q"], lora.modules[0, "v"]
    assert qkv.ranks[1].tolist() == [8, 0, 8]
    assert torch.equal(qkv.a_of(1, 0), q.a) and torch.equal(qkv.a_of(1, 2), v.a)
    assert torch.equal(qkv.b_of(1, 0), q.b) and torch.equal(qkv.b_of(1, 2), v.b)
    assert qkv.a_offsets[1, 0] == 7 and not stack.pool[:7].any()
    assert stack[1, "down"].ranks[1].tolist() == [8]
    assert stack[1, "gate_up"].ranks[1].tolist() == [0, 0] and stack[1, "o"].ranks[1].tolist() == [
        0
    ]
    assert not any(s.ranks[0].any() for s in stack.groups.values())
    assert not stack.pool[7 + LoraStack.region_elements(lora) :].any()


@pytest.mark.parametrize("group", list(GROUPS))
def test_stacked_output_equals_the_adapters_delta(tmp_path: Path, group: str) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=["q_proj", "k_proj", "up_proj", "o_proj"])
    stack = pooled(max_slots=4, max_rank=32)
    stack.write_slot(2, lora, 100)
    generator = torch.Generator().manual_seed(0)
    in_features = stack[0, group].in_features
    x = torch.randn(5, in_features, generator=generator)
    for layer in range(2):
        torch.testing.assert_close(
            fused_lora_output(stack, layer, group, 2, x),
            expected_lora_output(lora, layer, group, x),
        )


def test_write_replaces_the_previous_adapter_and_clear_empties(tmp_path: Path) -> None:
    everything = adapter(tmp_path / "all", r=16, lora_alpha=16, target_modules=ALL_SEVEN)
    q_only = adapter(tmp_path / "q", r=4, target_modules=["q_proj"], seed=1)
    stack = pooled(max_slots=2, max_rank=16)
    size = LoraStack.region_elements(everything)
    stack.write_slot(0, everything, 0)
    stack.write_slot(1, everything, size)
    stack.write_slot(0, q_only, 0)
    qkv = stack[1, "qkv"]
    assert qkv.ranks.tolist() == [[4, 0, 0], [16, 16, 16]]
    x = torch.randn(3, 64)
    torch.testing.assert_close(
        fused_lora_output(stack, 1, "qkv", 0, x), expected_lora_output(q_only, 1, "qkv", x)
    )
    stack.clear_slot(0)
    assert not any(s.ranks[0].any() or s.a_offsets[0].any() for s in stack.groups.values())
    torch.testing.assert_close(
        fused_lora_output(stack, 0, "gate_up", 1, torch.ones(2, 64)),
        expected_lora_output(everything, 0, "gate_up", torch.ones(2, 64)),
    )


def test_write_casts_to_the_stack_dtype(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8)
    stack = pooled(max_slots=1, max_rank=8, dtype=torch.float16)
    stack.write_slot(0, lora, 0)
    assert torch.equal(stack[0, "qkv"].b_of(0, 0), lora.modules[0, "q"].b.half())


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
    stack = pooled(max_slots=2, max_rank=16)
    stack.write_slot(0, resident, 0)
    before = (stack.pool.clone(), {key: s.a_offsets.clone() for key, s in stack.groups.items()})
    with pytest.raises(RankOverLimit):
        stack.write_slot(0, too_wide, 0)
    with pytest.raises(ShapeMismatch):
        stack.write_slot(0, foreign, 0)
    with pytest.raises(IndexError):
        stack.write_slot(2, resident, 0)
    with pytest.raises(IndexError, match="outside the pool"):
        stack.write_slot(1, resident, stack.pool_elements - 1)
    with pytest.raises(IndexError):
        stack.clear_slot(-1)
    assert torch.equal(before[0], stack.pool)
    assert all(torch.equal(before[1][key], s.a_offsets) for key, s in stack.groups.items())
    assert stack[0, "qkv"].ranks[0].tolist() == [8, 0, 8]


@pytest.mark.gpu
def test_slots_on_a_cuda_device_match_the_cpu_layout(tmp_path: Path) -> None:
    lora = adapter(tmp_path / "a", r=8, target_modules=ALL_SEVEN)
    elements = LoraStack.full_rank_elements(tiny_base(), 16)
    on_cpu = LoraStack.allocate(tiny_base(), 2, 16, elements, torch.bfloat16, "cpu")
    on_gpu = LoraStack.allocate(tiny_base(), 2, 16, elements, torch.bfloat16, "cuda")
    on_cpu.write_slot(1, lora, 5)
    on_gpu.write_slot(1, lora, 5)
    torch.cuda.synchronize()
    assert on_gpu.pool.device.type == "cuda" and torch.equal(on_gpu.pool.cpu(), on_cpu.pool)
    for key, stacked in on_gpu.groups.items():
        assert stacked.ranks.device.type == "cuda"
        assert torch.equal(stacked.a_offsets.cpu(), on_cpu[key].a_offsets)
        assert torch.equal(stacked.b_offsets.cpu(), on_cpu[key].b_offsets)
        assert torch.equal(stacked.ranks.cpu(), on_cpu[key].ranks)


def test_a_dora_adapter_region_holds_each_scale_after_its_pair(tmp_path: Path) -> None:
    model = tiny_model()
    folder = make_peft_adapter(tmp_path / "d", r=4, use_dora=True, target_modules=["k_proj"])
    dora = load_peft_adapter(folder, tiny_base(), base_weights=HfBaseWeights(model))
    # per layer: k's A [4, 64], B [32, 4], then its scale [32]
    assert LoraStack.region_elements(dora) == 2 * (4 * 64 + 32 * 4 + 32)
    stack = pooled(max_slots=2, max_rank=16)
    stack.write_slot(1, dora, 10)
    qkv = stack[0, "qkv"]
    assert qkv.scale_offsets[1].tolist() == [-1, 10 + 4 * 64 + 32 * 4, -1]
    assert qkv.scale_offsets[0].tolist() == [-1, -1, -1]
    start = int(qkv.scale_offsets[1, 1])
    assert torch.equal(stack.pool[start : start + 32], dora.modules[0, "k"].scale)
    layer_one = 10 + (4 * 64 + 32 * 4 + 32)  # layer 1's k follows layer 0's whole block
    assert int(stack[1, "qkv"].scale_offsets[1, 1]) == layer_one + 4 * 64 + 32 * 4
    stack.clear_slot(1)
    assert all((s.scale_offsets == -1).all() for s in stack.groups.values())
