"""Device copies into adapter slots: on the CPU a bounded number of (layer, group) blocks per
step, shared by every copy under way, and a completed copy equals a direct slot write."""

from __future__ import annotations

from pathlib import Path

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.layout import LoraStack
from loramux.adapters.peft_format import load_peft_adapter
from loramux.engine.lora.slot_copy import SlotCopies


def _stacks(base: BaseModelSpec) -> tuple[LoraStack, LoraStack]:
    """Two empty two-slot stacks: one filled by copies, one by direct writes."""
    elements = 2 * LoraStack.full_rank_elements(base, 64)
    return (
        LoraStack.allocate(base, 2, 64, elements, torch.float32, "cpu"),
        LoraStack.allocate(base, 2, 64, elements, torch.float32, "cpu"),
    )


def _assert_same(copied: LoraStack, direct: LoraStack, slots: range) -> None:
    """The slots point at equal weights at equal places in both pools."""
    for key, stacked in copied.groups.items():
        other = direct[key]
        for slot in slots:
            assert torch.equal(stacked.ranks[slot], other.ranks[slot]), key
            assert torch.equal(stacked.a_offsets[slot], other.a_offsets[slot]), key
            assert torch.equal(stacked.b_offsets[slot], other.b_offsets[slot]), key
            for index in range(stacked.ranks.shape[1]):
                assert torch.equal(stacked.a_of(slot, index), other.a_of(slot, index)), key
                assert torch.equal(stacked.b_of(slot, index), other.b_of(slot, index)), key


def test_copies_share_the_per_step_budget_and_end_equal_to_a_direct_write(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    first, second = (load_peft_adapter(f, base) for f in demo_adapter_dirs[:2])
    copied, direct = _stacks(base)
    blocks = len(copied.groups)  # 4 layers x 4 groups on the demo model
    copies = SlotCopies(copied, torch.device("cpu"), groups_per_step=5)
    second_start = LoraStack.region_elements(first)
    copies.start(0, first, 0)
    copies.start(1, second, second_start)
    completed_at: dict[int, int] = {}
    for step in range(1, 2 * blocks):
        for slot in copies.advance():
            completed_at[slot] = step
        if len(completed_at) == 2:
            break
    # 32 blocks at 5 a step: the first copy's 16 take 4 steps (it goes first), both take 7.
    assert completed_at == {0: 4, 1: 7}
    assert len(copies) == 0
    direct.write_slot(0, first, 0)
    direct.write_slot(1, second, second_start)
    _assert_same(copied, direct, range(2))
    assert torch.equal(copied.pool, direct.pool)


def test_a_cancelled_copy_stops_and_its_slot_can_be_copied_into_again(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    first, second = (load_peft_adapter(f, base) for f in demo_adapter_dirs[:2])
    copied, direct = _stacks(base)
    copies = SlotCopies(copied, torch.device("cpu"), groups_per_step=3)
    copies.start(0, first, 0)
    copies.advance()
    assert copies.copying(0) and copies.adapter(0) is first
    copies.cancel(0)
    assert not copies.copying(0)
    copies.start(0, second, 0)
    while copies.copying(0):
        copies.advance()
    direct.write_slot(0, second, 0)
    _assert_same(copied, direct, range(1))
