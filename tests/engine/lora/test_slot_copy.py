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
    return (
        LoraStack.allocate(base, 2, 64, torch.float32, "cpu"),
        LoraStack.allocate(base, 2, 64, torch.float32, "cpu"),
    )


def test_copies_share_the_per_step_budget_and_end_equal_to_a_direct_write(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    first, second = (load_peft_adapter(f, base) for f in demo_adapter_dirs[:2])
    copied, direct = _stacks(base)
    blocks = len(copied.groups)  # 4 layers x 4 groups on the demo model
    copies = SlotCopies(copied, torch.device("cpu"), groups_per_step=5)
    copies.start(0, first)
    copies.start(1, second)
    completed_at: dict[int, int] = {}
    for step in range(1, 2 * blocks):
        for slot in copies.advance():
            completed_at[slot] = step
        if len(completed_at) == 2:
            break
    # 32 blocks at 5 a step: the first copy's 16 take 4 steps (it goes first), both take 7.
    assert completed_at == {0: 4, 1: 7}
    assert len(copies) == 0
    direct.write_slot(0, first)
    direct.write_slot(1, second)
    for key, stacked in copied.groups.items():
        other = direct[key]
        assert torch.equal(stacked.lora_a, other.lora_a), key
        assert torch.equal(stacked.lora_b, other.lora_b), key
        assert torch.equal(stacked.ranks, other.ranks), key


def test_a_cancelled_copy_stops_and_its_slot_can_be_copied_into_again(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    first, second = (load_peft_adapter(f, base) for f in demo_adapter_dirs[:2])
    copied, direct = _stacks(base)
    copies = SlotCopies(copied, torch.device("cpu"), groups_per_step=3)
    copies.start(0, first)
    copies.advance()
    assert copies.copying(0) and copies.adapter(0) is first
    copies.cancel(0)
    assert not copies.copying(0)
    copies.start(0, second)
    while copies.copying(0):
        copies.advance()
    direct.write_slot(0, second)
    for key, stacked in copied.groups.items():
        assert torch.equal(stacked.lora_a[0], direct[key].lora_a[0]), key
        assert torch.equal(stacked.lora_b[0], direct[key].lora_b[0]), key
