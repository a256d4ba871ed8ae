"""Host memory for parsed adapters: a bounded pool of flat float32 buffers, reused.

Every adapter in the host tier lives in one buffer (its A and B matrices, and DoRA's scales,
are views into it).
On CUDA the buffers are pinned, so device copies from them run asynchronously; pinning is slow
(a page-locking system call), which is why buffers are recycled when an adapter leaves the host
tier instead of allocated per load. A buffer is taken at the smallest free size that fits, and
allocated at a size class (eight per doubling, `size_class`) so that adapters of neighbouring
sizes share buffers while at most an eighth of a buffer is waste (powers of two wasted up to half:
a 168 MB rank-16 adapter of a Llama-3-8B took 256 MB of pinned memory).

`capacity` bounds the buffers in use: `take` past it is an internal error, since the manager
sizes the pool for its host tier plus the loads in flight. Free buffers beyond what the pool
keeps are dropped, so memory held is bounded too.

Thread-safe: loader threads take buffers, the step thread and loaders give them back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from loramux.adapters.peft_format import LoraAdapter
from loramux.adapters.weights import LoraWeights

MIN_BUFFER_FLOATS = 1 << 12
"""The smallest buffer handed out (16 KiB): tiny adapters share one size class."""


@dataclass(frozen=True)
class HostBufferCounts:
    """How many buffers exist and where they are: `in_use` is what a leak check reads."""

    in_use: int
    free: int
    allocated: int
    """Buffers ever allocated: grows only when no free buffer fits."""
    capacity: int


class HostBufferPool:
    def __init__(self, capacity: int, pinned: bool) -> None:
        assert capacity >= 1, "a host buffer pool needs room for one adapter"
        self.capacity = capacity
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._in_use: dict[int, torch.Tensor] = {}
        self._allocated = 0
        self._lock = threading.Lock()

    def take(self, num_floats: int) -> torch.Tensor:
        """A float32 buffer of at least `num_floats` (its contents are stale: overwrite them)."""
        size = size_class(num_floats)
        with self._lock:
            assert len(self._in_use) < self.capacity, "more host buffers taken than the pool holds"
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= size]
            if fitting:  # (by index: `list.remove` would compare tensors by value)
                buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
            else:
                buffer = torch.empty(size, dtype=torch.float32, pin_memory=self.pinned)
                self._allocated += 1
            self._in_use[buffer.data_ptr()] = buffer
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer from `take`; the adapter in it must no longer be read."""
        with self._lock:
            taken = self._in_use.pop(buffer.data_ptr(), None)
            assert taken is buffer, "a host buffer given back that the pool did not hand out"
            self._free.append(buffer)
            spare = len(self._free) + len(self._in_use) - self.capacity
            if spare > 0:  # keep at most `capacity` buffers alive: drop the smallest spares
                self._free.sort(key=torch.Tensor.numel)
                del self._free[:spare]

    def counts(self) -> HostBufferCounts:
        with self._lock:
            return HostBufferCounts(
                len(self._in_use), len(self._free), self._allocated, self.capacity
            )


def size_class(num_floats: int) -> int:
    """The buffer size `num_floats` is allocated at: at least MIN_BUFFER_FLOATS, else the next
    multiple of a sixteenth of the power of two at or above it (eight classes per doubling)."""
    n = max(MIN_BUFFER_FLOATS, num_floats)
    step = (1 << (n - 1).bit_length()) // 16
    return -(-n // step) * step


def adapter_floats(adapter: LoraAdapter) -> int:
    """The float32 values of an adapter's weights: the buffer size it needs."""
    return sum(t.numel() for t in adapter.flat_tensors())


def move_into(adapter: LoraAdapter, buffer: torch.Tensor) -> LoraAdapter:
    """The same adapter with its weights copied into `buffer` (at least `adapter_floats` long)."""
    offset = 0

    def view(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        moved = buffer[offset : offset + tensor.numel()].view(tensor.shape).copy_(tensor)
        offset += tensor.numel()
        return moved

    def moved(weights: LoraWeights) -> LoraWeights:
        return LoraWeights(*map(view, weights.tensors()))

    return replace(
        adapter,
        modules={module: moved(weights) for module, weights in adapter.modules.items()},
        top={module: moved(adapter.top[module]) for module in sorted(adapter.top)},
        saved={module: view(adapter.saved[module]) for module in sorted(adapter.saved)},
    )
