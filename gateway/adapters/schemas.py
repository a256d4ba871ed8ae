"""Wire shapes of `/admin/adapters`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from msgspec import Meta, Struct


class AdapterOut(Struct):
    owner: str
    """A tenant id, or `shared`."""
    name: str
    version: int
    digest: str
    """The content digest the engine knows the adapter by."""
    rank: int
    targets: list[str]
    size_bytes: int
    created_at: datetime


class CurrentVersion(Struct, forbid_unknown_fields=True):
    version: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    """A live version of the adapter, to serve from now on."""


class AdapterPage(Struct):
    items: list[AdapterOut]
    total: int
    """Adapters the filter matches, on every page."""
    limit: int
    offset: int


@dataclass(frozen=True)
class Published:
    adapter: AdapterOut
    created: bool
    """False when nothing new was published: the bytes or version were already current."""


class AdapterDetail(Struct):
    owner: str
    name: str
    latest: AdapterOut
    versions: list[AdapterOut]
    """Every live version, oldest first."""
