"""Where each adapter lives: device slots ◀ host tier ◀ its folder on disk.

- A *registered* adapter is known by its content digest and its folder; requests name it by
  digest. Registration validates it (and leaves it in the host tier).
- The *host tier* (`max_cpu_loras`, engine.lora.host_tier) holds parsed adapters, least
  recently used out first, each in a buffer from a bounded, recycled pool (pinned on CUDA).
  Loads from disk run on a small pool of loader threads, never on the step loop; waiting
  requests prefetch.
- *Device memory* is one pool (`memory_bytes`) where each resident adapter holds a region
  sized by its own ranks (adapters.layout), addressed by a slot: a row of the kernels' tables
  (`max_loras` rows, a bound on resident adapters). A slot is pinned while any running
  sequence uses it. A new adapter goes to the first free range it fits; while none is long
  enough, unpinned adapters are evicted least recently used first (freed neighbours merge).
  So many small adapters fit where few large ones do.
- Entering a slot is a copy spread over steps (engine.lora.slot_copy). Until it completes the
  adapter's requests run anyway, their LoRA work computed from the host copy
  (engine.lora.host_path), and the adapter stays in the host tier whatever its age.
- *Retiring* an adapter refuses new requests at once and drops it when its last request ends.

Threads: `register`/`retire`/`is_servable`/`hint` may be called from any thread; everything else
runs on the engine's step thread. `_lock` guards the registry and the host tier.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.errors import DoraUnsupported, OverMemoryBudget
from loramux.adapters.layout import LoraStack, TopWeights
from loramux.adapters.peft_format import AdapterLimits, LoraAdapter, load_peft_adapter
from loramux.adapters.peft_top import BaseWeights
from loramux.engine.lora.host_buffers import HostBufferPool, adapter_floats, move_into
from loramux.engine.lora.host_tier import HostTier
from loramux.engine.lora.memory import RegionAllocator, pool_elements
from loramux.engine.lora.slot_copy import SlotCopies
from loramux.engine.lora.stats import AdapterStats, Readiness
from loramux.engine.sequence import BASE_ADAPTER, Sequence

LARGE_SHARE = 0.25
"""An adapter whose region is over this share of the pool may defer to smaller ones rather
than evict resident adapters (Scheduler.max_large_adapter_defer_steps bounds the wait)."""


def default_load_workers() -> int:
    """Loader threads: parsing is mostly file reads and float conversion, a few suffice."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass
class _Slot:
    digest: str | None = None
    pins: int = 0
    last_used: int = 0
    start: int = 0
    """The region's first pool element and its length (0: the slot is empty)."""
    length: int = 0


class LoraManager:
    def __init__(
        self,
        base: BaseModelSpec,
        max_loras: int,
        max_cpu_loras: int,
        limits: AdapterLimits,
        dtype: torch.dtype,
        device: str,
        memory_bytes: int | None = None,
        load_workers: int | None = None,
        copy_groups_per_step: int = 8,
        base_weights: BaseWeights | None = None,
    ):
        self.base = base
        self.limits = limits
        self.base_weights = base_weights
        """The base model's projection weights, which DoRA's scales are computed from (None:
        DoRA adapters are refused)."""
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        elements = pool_elements(base, max_loras, limits.max_rank, memory_bytes, dtype)
        self.stack = LoraStack.allocate(base, max_loras, limits.max_rank, elements, dtype, device)
        self.regions = RegionAllocator(elements)
        workers = load_workers or default_load_workers()
        self._lock = threading.Lock()
        self.host = HostTier(
            self.max_cpu_loras,
            # The tier, plus adapters kept there past capacity while copied into a slot or
            # about to be (one more), a load per loader thread and a registration being put in.
            self.max_cpu_loras + max_loras + workers + 2,
            workers,
            torch.device(device).type == "cuda",
            self._lock,
            self._parse,
            self._loaded,
        )
        self.copies = SlotCopies(self.stack, torch.device(device), copy_groups_per_step)
        self.steps = 0
        self.max_hinted_loads = 2 * workers
        self.on_load: Callable[[float], None] = lambda seconds: None
        self.on_drop: Callable[[str], None] = lambda digest: None
        """Told each retired adapter dropped (step thread, lock held: it must not wait)."""
        """Told each load's seconds (from a loader thread): the engine's metrics."""
        self.slots = [_Slot() for _ in range(max_loras)]
        self._slot_of: dict[str, int] = {}
        self._folders: dict[str, Path] = {}
        self._retired: set[str] = set()
        self._users: dict[str, int] = {}
        self._clock = 0
        self.stats: dict[str, AdapterStats] = {}

    # -- registry (any thread) ---------------------------------------------------------------
    def register(self, folder: Path) -> str:
        """Validate the adapter in `folder`; returns its digest. Raises adapters.errors.AdapterError."""
        started = time.monotonic()
        adapter = load_peft_adapter(folder, self.base, self.limits, base_weights=self.base_weights)
        if adapter.use_dora and self.base_weights is None:
            raise DoraUnsupported("this engine has no base weights to compute DoRA's scales from")
        adapter.refuse_unrepresentable(self.stack.pool.dtype)
        needed = LoraStack.region_elements(adapter)
        if needed > self.regions.size:
            element = self.stack.pool.element_size()
            raise OverMemoryBudget(
                f"the adapter needs {needed * element} bytes of device memory at its ranks; "
                f"the engine's adapter memory is {self.regions.size * element} bytes"
            )
        with self._lock:
            self._folders[adapter.digest] = Path(folder)
            self._retired.discard(adapter.digest)
            self.host.forget_failure(adapter.digest)
            self._loaded(adapter.digest, time.monotonic() - started)
            buffer = self.host_buffers.take(adapter_floats(adapter))
            self.host.put(move_into(adapter, buffer), buffer)
        return adapter.digest

    def retire(self, digest: str) -> bool:
        """Refuse new requests for `digest`; it is dropped once its last request ends."""
        with self._lock:
            if digest not in self._folders:
                return False
            self._retired.add(digest)
        return True

    def is_servable(self, digest: str) -> bool:
        with self._lock:
            return digest in self._folders and digest not in self._retired

    def holds(self, digest: str) -> bool:
        """Whether `digest` is registered: servable, or retired and still in use."""
        with self._lock:
            return digest in self._folders

    # -- sequences (step thread) -------------------------------------------------------------
    def add_users(self, choices: list[Sequence]) -> bool:
        """Count a new request's choices as users of their adapter, unless it is not servable
        (retired, or retired and dropped, since the request was checked): then False, and none
        counted. Checked and counted under the lock `retire` takes: a request is never queued
        for an adapter a sweep has dropped (it would wait for it forever), and the sweep drops
        none a request counted here still uses."""
        digest = choices[0].adapter_id
        if digest == BASE_ADAPTER:
            return True
        with self._lock:
            if digest not in self._folders or digest in self._retired:
                return False
            if digest not in self._users:  # a failed load is retried for new requests
                self.host.forget_failure(digest)
            self._users[digest] = self._users.get(digest, 0) + len(choices)
        self.stats.setdefault(digest, AdapterStats()).requests += 1
        return True

    def remove_user(self, seq: Sequence) -> None:
        digest = seq.adapter_id
        if digest == BASE_ADAPTER:
            return
        self._users[digest] -= 1
        if self._users[digest] == 0:
            del self._users[digest]

    def sweep(self) -> None:
        """Drop retired adapters that no request uses any more (step thread, between steps)."""
        with self._lock:
            for digest in [d for d in self._retired if d not in self._users]:
                self._drop(digest)

    def readiness(self, seq: Sequence, may_defer: bool = False) -> Readiness:
        """READY, LOADING, NO_SLOT or FAILED (see Readiness); with `may_defer`, also NO_SLOT for
        an adapter whose region is over LARGE_SHARE of the pool and does not fit without
        evicting."""
        digest = seq.adapter_id
        if digest == BASE_ADAPTER or digest in self._slot_of:
            return Readiness.READY
        with self._lock:
            if digest not in self._folders:  # nothing can load it: waiting would be forever
                return Readiness.FAILED
            adapter = self.host.get(digest)
            if adapter is None and self.host.failed(digest):
                return Readiness.FAILED
            ready = (
                adapter is not None
                and self._can_place(adapter)
                and not (may_defer and self._crowds_out(adapter))
            )
            if ready:  # a loader finishing before `acquire` must not evict it
                self.host.reserved.add(digest)
        if adapter is None:
            self.prefetch(seq)
            return Readiness.LOADING
        return Readiness.READY if ready else Readiness.NO_SLOT

    def acquire(self, seq: Sequence) -> None:
        """Pin `seq`'s adapter in a slot (loading it there first); requires readiness READY."""
        digest = seq.adapter_id
        if digest == BASE_ADAPTER:
            return
        slot = self._slot_of.get(digest)
        if slot is None:
            slot = self._load_into_slot(digest)
        self.slots[slot].pins += 1

    def release(self, seq: Sequence) -> None:
        slot = self._slot_of.get(seq.adapter_id)
        if slot is not None:
            self.slots[slot].pins -= 1
            assert self.slots[slot].pins >= 0, "slot released more often than acquired"

    def slot_of(self, digest: str) -> int | None:
        """The device slot of a running sequence's adapter; None for the base model and while
        the adapter's device copy is under way (see `host_adapter`)."""
        if digest == BASE_ADAPTER:
            return None
        slot = self._slot_of[digest]
        self._clock += 1
        self.slots[slot].last_used = self._clock
        return None if self.copies.copying(slot) else slot

    def host_adapter(self, digest: str) -> LoraAdapter | None:
        """The host copy serving a running sequence's adapter while its device copy is under
        way; None for the base model and once the slot is usable."""
        slot = self._slot_of.get(digest)
        if slot is None or not self.copies.copying(slot):
            return None
        return self.copies.adapter(slot)

    def top_weights(self, digest: str) -> TopWeights | None:
        """A running sequence's adapter's embedding and lm_head weights, from its slot, or
        from its host copy while the device copy is under way; None when it has none."""
        if digest == BASE_ADAPTER:
            return None
        slot = self._slot_of[digest]
        if self.copies.copying(slot):
            return TopWeights.of(self.copies.adapter(slot))
        return self.stack.top.entries[slot]

    def count_host_path(self, digest: str, tokens: int) -> None:
        self.stats[digest].host_path_tokens += tokens

    def advance(self) -> None:
        """Between steps (step thread): progress the device copies; an adapter whose copy
        completed serves from its slot from the next step on and may leave the host tier."""
        self.steps += 1
        with self._lock:
            self.host.reserved.clear()
        for slot in self.copies.advance():
            digest = self.slots[slot].digest
            assert digest is not None, "a copy into an empty slot"
            self.stats[digest].device_ready_step = self.steps
            with self._lock:
                self.host.held.discard(digest)
                self.host.trim()

    def prefetch(self, seq: Sequence) -> None:
        """Start reading `seq`'s adapter from disk into the host tier unless it is there or coming."""
        self._prefetch(seq.adapter_id, hint=False)

    def hint(self, digest: str) -> None:
        """A request for `digest` is on its way (any thread): prefetch it, unless it is unknown
        or retired, or the loaders already have `max_hinted_loads` loads in hand (hints never
        crowd out the waiting queue's own prefetches)."""
        self._prefetch(digest, hint=True)

    def _prefetch(self, digest: str, hint: bool) -> None:
        if digest == BASE_ADAPTER:
            return
        with self._lock:
            if (
                digest in self.host
                or self.host.loading(digest)
                or self.host.failed(digest)
                or digest not in self._folders
            ):
                return
            if hint and (digest in self._retired or self.host.in_flight() >= self.max_hinted_loads):
                return
            self.stats[digest].hinted_loads += hint
            self.host.load(digest, self._folders[digest])

    def resident(self) -> dict[str, str]:
        """Adapters held in memory, by tier: `device` (in a slot) or `host` (any thread). Bounded
        by the tiers' capacities, so metrics may label series by these digests."""
        in_slots = dict(self._slot_of)
        with self._lock:
            in_host = list(self.host)
        return {d: "host" for d in in_host} | {d: "device" for d in in_slots}

    def memory(self) -> tuple[int, int]:
        """Device adapter memory in bytes: (used by resident adapters, the whole pool)."""
        element = self.stack.pool.element_size()
        return self.regions.used * element, self.regions.size * element

    def count_tokens(self, digest: str, tokens: int) -> None:
        if digest != BASE_ADAPTER:
            stats = self.stats.setdefault(digest, AdapterStats())
            stats.tokens += tokens
            if stats.first_token_step is None:
                stats.first_token_step = self.steps

    def host_tier_size(self) -> int:
        """Adapters in the host tier (each holds one host buffer)."""
        with self._lock:
            return len(self.host)

    def in_flight_loads(self) -> int:
        with self._lock:
            return self.host.in_flight()

    @property
    def host_buffers(self) -> HostBufferPool:
        return self.host.buffers

    def shutdown(self) -> None:
        self.host.shutdown()

    # -- internals -----------------------------------------------------------------------------
    def _parse(self, folder: Path, storage: Callable[[int], torch.Tensor]) -> LoraAdapter:
        """A loader thread's parse of an adapter into host storage."""
        return load_peft_adapter(folder, self.base, self.limits, storage, self.base_weights)

    def _loaded(self, digest: str, seconds: float) -> None:
        """A load from disk entered the host tier (lock held)."""
        stats = self.stats.setdefault(digest, AdapterStats())
        stats.loads += 1
        stats.load_seconds += seconds
        self.on_load(seconds)

    def _unpinned(self) -> list[int]:
        """Slots holding an adapter no running sequence uses."""
        return [i for i, s in enumerate(self.slots) if s.digest is not None and s.pins == 0]

    def _can_place(self, adapter: LoraAdapter) -> bool:
        """Whether `_load_into_slot` can make the adapter resident, evicting only unpinned ones."""
        unpinned = self._unpinned()
        if not unpinned and all(s.digest is not None for s in self.slots):
            return False
        regions = [(self.slots[i].start, self.slots[i].length) for i in unpinned]
        return self.regions.fits_after_release(LoraStack.region_elements(adapter), regions)

    def _crowds_out(self, adapter: LoraAdapter) -> bool:
        """A large adapter that would have to evict resident ones to fit."""
        length = LoraStack.region_elements(adapter)
        if length <= LARGE_SHARE * self.regions.size:
            return False
        has_row = any(s.digest is None for s in self.slots)
        return not (has_row and self.regions.largest_free >= length)

    def _evict_least_recent(self) -> None:
        unpinned = self._unpinned()
        assert unpinned, "acquire() without room for the adapter"
        slot = min(unpinned, key=lambda i: self.slots[i].last_used)
        digest = self.slots[slot].digest
        assert digest is not None
        self.stats[digest].evictions += 1
        self._vacate(slot)
        with self._lock:  # an unfinished device copy no longer keeps it in the host tier
            if digest in self.host.held:
                self.host.held.discard(digest)
                self.host.trim()

    def _vacate(self, slot: int) -> None:
        """Empty `slot`, abandoning a device copy into it, and free its region."""
        held = self.slots[slot]
        assert held.digest is not None and held.pins == 0, "vacating a pinned or empty slot"
        self.copies.cancel(slot)
        del self._slot_of[held.digest]
        stats = self.stats[held.digest]
        stats.resident_since, stats.device_bytes = None, 0
        self.stack.clear_slot(slot)
        self.regions.release(held.start, held.length)
        self.slots[slot] = _Slot()

    def _load_into_slot(self, digest: str) -> int:
        """Make the adapter resident: a free slot and the first free range that fits, evicting
        least recently used unpinned adapters until both exist; then start its device copy."""
        with self._lock:
            adapter = self.host.use(digest)
            self.host.held.add(digest)
        length = LoraStack.region_elements(adapter)
        while all(s.digest is not None for s in self.slots):
            self._evict_least_recent()
        while (start := self.regions.allocate(length)) is None:
            self._evict_least_recent()
        slot = next(i for i, s in enumerate(self.slots) if s.digest is None)
        self.copies.start(slot, adapter, start)  # validated when registered: cannot refuse
        self.slots[slot] = _Slot(digest, 0, self._clock, start, length)
        self._slot_of[digest] = slot
        stats = self.stats.setdefault(digest, AdapterStats())
        stats.slot_loads += 1
        stats.resident_since = time.monotonic()
        stats.device_bytes = length * self.stack.pool.element_size()
        return slot

    def _drop(self, digest: str) -> None:
        """Forget a retired adapter nobody uses any more (lock held)."""
        self._folders.pop(digest, None)
        self._retired.discard(digest)
        self.host.forget_failure(digest)
        slot = self._slot_of.get(digest)
        if slot is not None:
            self._vacate(slot)
        self.host.held.discard(digest)
        self.host.evict(digest)
        self.on_drop(digest)
