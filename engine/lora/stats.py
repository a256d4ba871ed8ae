"""What the adapter manager (engine.lora.manager) tells the rest of the engine: whether a
sequence's adapter is ready to run, and each adapter's counters (for stats and metrics)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Readiness(enum.Enum):
    READY = "ready"
    """The adapter is resident, or can be made resident now."""
    LOADING = "loading"
    """Its weights are still on their way from disk: skip the request for now, it will be back."""
    NO_SLOT = "no_slot"
    """Its region does not fit even after evicting every unpinned adapter (or every slot is
    pinned): the adapters running sequences pin must finish first."""
    FAILED = "failed"
    """Its weights could not be read from its folder (deleted, unreadable, or changed on disk
    since it was registered), or it is not registered at all (nothing would ever load it): the
    request fails; a request arriving after the last one waiting for it has ended tries
    loading it again."""


@dataclass
class AdapterStats:
    requests: int = 0
    tokens: int = 0
    loads: int = 0
    """Times its weights were read from disk into the host tier."""
    slot_loads: int = 0
    evictions: int = 0
    """Times it lost its device memory to another adapter."""
    device_bytes: int = 0
    """Device memory its region holds now; 0 when not resident."""
    load_seconds: float = 0.0
    resident_since: float | None = None
    """time.monotonic() when it last entered a device slot; None when not in one."""
    hinted_loads: int = 0
    """Loads started by a gateway's hint rather than by the waiting queue."""
    host_path_tokens: int = 0
    """Tokens whose LoRA work came from the host copy while the device copy was under way."""
    first_token_step: int | None = None
    """The engine step at which its first sampled token was counted (LoraManager.steps)."""
    device_ready_step: int | None = None
    """The engine step at which its latest device copy completed."""
