"""Device copies of adapters into their slots, spread so that none stalls a step.

- On CUDA a copy runs on a side stream, after the work already queued on the compute stream
  (which may still read the slot's previous adapter), and records an event; the slot is usable
  once the event has completed. The step never waits for it.
- On the CPU the "device" is host memory and a copy is plain work on the step thread, so it is
  spread over steps: at most `groups_per_step` (layer, group) blocks of all copies together per
  step. One big adapter then costs each step a bounded amount of copying.

While a copy is under way the slot holds a partial adapter: its requests' LoRA work comes from
the host copy (engine.lora.host_path) and the slot's weights are read by no kernel. The source
host tensors must stay untouched until the copy completes or is cancelled (the manager keeps
the adapter in its host tier until then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loramux.adapters.layout import LoraStack
from loramux.adapters.peft_format import LoraAdapter


@dataclass
class _SlotCopy:
    adapter: LoraAdapter
    pending: list[tuple[tuple[int, str], int]] = field(default_factory=list)
    """(layer, group) blocks still to write and where each begins in the pool (CPU)."""
    done: torch.cuda.Event | None = None
    """Recorded on the side stream after the whole copy (CUDA)."""


class SlotCopies:
    def __init__(self, stack: LoraStack, device: torch.device, groups_per_step: int) -> None:
        assert groups_per_step >= 1, "a copy must make progress every step"
        self.stack = stack
        self.groups_per_step = groups_per_step
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies: dict[int, _SlotCopy] = {}

    def start(self, slot: int, adapter: LoraAdapter, start: int) -> None:
        """Begin copying `adapter` into `slot`, its region from pool element `start` (memory
        nobody reads any more)."""
        assert slot not in self._copies, "a slot copied into twice at once"
        if self._stream is None:
            pending = self.stack.block_starts(adapter, start)
            self._copies[slot] = _SlotCopy(adapter, pending=pending)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self.stack.write_slot(slot, adapter, start)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._copies[slot] = _SlotCopy(adapter, done=done)

    def copying(self, slot: int) -> bool:
        return slot in self._copies

    def adapter(self, slot: int) -> LoraAdapter:
        """The adapter being copied into `slot`: its host weights serve its tokens meanwhile."""
        return self._copies[slot].adapter

    def cancel(self, slot: int) -> None:
        """Abandon the copy into `slot` (its adapter is being evicted). On CUDA this waits for
        the copy in flight, so its source host memory may be reused: rare (the sequences using
        the slot all ended before the copy did) and short (one adapter's transfer)."""
        copy = self._copies.pop(slot, None)
        if copy is not None and copy.done is not None:
            copy.done.synchronize()

    def advance(self) -> list[int]:
        """Make this step's progress; the slots whose copy completed (usable from now on)."""
        completed = []
        budget = self.groups_per_step
        for slot, copy in list(self._copies.items()):
            if copy.done is not None:
                finished = copy.done.query()
            else:
                while copy.pending and budget > 0:
                    key, start = copy.pending.pop()
                    self.stack.write_block(slot, key, copy.adapter, start)
                    budget -= 1
                finished = not copy.pending
            if finished:
                del self._copies[slot]
                completed.append(slot)
        return completed

    def __len__(self) -> int:
        return len(self._copies)
