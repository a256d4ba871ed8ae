"""The host tier: parsed adapters in pooled host buffers, least recently used out first.

Each adapter in the tier holds one buffer from a bounded, recycled pool (pinned on CUDA:
engine.lora.host_buffers). Loads from disk run on a small pool of loader threads, never on the
step loop. The tier keeps, whatever their age, the adapters whose device copy is under way
(`held`: the copy reads their host weights) and those `readiness` found here this step
(`reserved`: a loader finishing before `acquire` must not evict them). A load that fails (the
folder deleted, unreadable, or changed on disk) is remembered (`failed`) until the manager
forgets it, so that the requests waiting for it fail instead of starting a load every step.

Locking: the tier shares its lock with the LoraManager that owns it, whose registry it must
agree with, so a check of both is one atomic step. Methods marked "lock held" expect the caller
to hold it; the loader threads take it themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from loramux.adapters.peft_format import LoraAdapter
from loramux.engine.lora.host_buffers import HostBufferPool

log = logging.getLogger(__name__)

Parse = Callable[[Path, Callable[[int], torch.Tensor]], LoraAdapter]
"""Parse the adapter in a folder, taking its host storage from the given allocator."""


class HostTier:
    def __init__(
        self,
        capacity: int,
        buffers: int,
        workers: int,
        on_cuda: bool,
        lock: threading.Lock,
        parse: Parse,
        loaded: Callable[[str, float], None],
    ) -> None:
        """`capacity` adapters (more while held or reserved), `buffers` host buffers in the
        pool, `workers` loader threads; `loaded(digest, seconds)` is told of each load from
        disk that entered the tier (lock held)."""
        self.capacity = capacity
        self.buffers = HostBufferPool(buffers, on_cuda)
        self.held: set[str] = set()
        self.reserved: set[str] = set()
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._buffer_of: dict[str, torch.Tensor] = {}
        self._loading: dict[str, Future[None]] = {}
        self._failed: set[str] = set()
        self._lock = lock
        self._parse = parse
        self._loaded = loaded
        self._loader = ThreadPoolExecutor(workers, thread_name_prefix="loramux-lora-load")

    # -- lock held -----------------------------------------------------------------------------
    def get(self, digest: str) -> LoraAdapter | None:
        return self._adapters.get(digest)

    def __contains__(self, digest: object) -> bool:
        return digest in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._adapters))

    def __len__(self) -> int:
        return len(self._adapters)

    def use(self, digest: str) -> LoraAdapter:
        """The adapter, now the most recently used."""
        self._adapters.move_to_end(digest)
        return self._adapters[digest]

    def put(self, adapter: LoraAdapter, buffer: torch.Tensor) -> None:
        """Insert (an adapter already here keeps its copy, `buffer` goes back to the pool)."""
        if adapter.digest in self._adapters:
            self.buffers.give_back(buffer)
        else:
            self._adapters[adapter.digest] = adapter
            self._buffer_of[adapter.digest] = buffer
        self._adapters.move_to_end(adapter.digest)
        self.trim()

    def trim(self) -> None:
        """Evict least recently used adapters beyond capacity, except held and reserved ones;
        their buffers go back to the pool."""
        excess = len(self._adapters) - self.capacity
        kept = self.held | self.reserved
        for digest in [d for d in self._adapters if d not in kept][: max(excess, 0)]:
            self.evict(digest)

    def evict(self, digest: str) -> None:
        """Take `digest` out of the tier (nothing may read its weights after)."""
        assert digest not in self.held, "evicting an adapter whose device copy reads it"
        if self._adapters.pop(digest, None) is not None:
            self.buffers.give_back(self._buffer_of.pop(digest))

    def loading(self, digest: str) -> bool:
        return digest in self._loading

    def in_flight(self) -> int:
        return len(self._loading)

    def failed(self, digest: str) -> bool:
        """Its last load failed, and no load was started since."""
        return digest in self._failed

    def forget_failure(self, digest: str) -> None:
        """Let the next request for `digest` try loading it again."""
        self._failed.discard(digest)

    def load(self, digest: str, folder: Path) -> None:
        """Start reading `digest` from `folder` on a loader thread."""
        self._failed.discard(digest)
        self._loading[digest] = self._loader.submit(self._load, digest, folder)

    # -- any thread ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)

    # -- loader threads ------------------------------------------------------------------------
    def _load(self, digest: str, folder: Path) -> None:
        """Parse into a pooled host buffer, then enter the tier."""
        started = time.monotonic()
        taken: list[torch.Tensor] = []

        def storage(num_floats: int) -> torch.Tensor:
            taken.append(self.buffers.take(num_floats))
            return taken[-1]

        try:
            adapter = self._parse(folder, storage)
        except Exception:
            log.exception("adapter %s could not be reloaded from %s", digest[:12], folder)
            for buffer in taken:
                self.buffers.give_back(buffer)
            with self._lock:
                self._loading.pop(digest, None)
                self._failed.add(digest)
            return
        with self._lock:
            self._loading.pop(digest, None)
            if adapter.digest != digest:
                log.error(
                    "adapter %s could not be reloaded: its folder %s changed on disk (digest %s)",
                    digest[:12],
                    folder,
                    adapter.digest[:12],
                )
                self.buffers.give_back(taken[0])
                self._failed.add(digest)
                return
            self._loaded(digest, time.monotonic() - started)
            self.put(adapter, taken[0])
