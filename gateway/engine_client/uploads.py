"""An adapter's files on their way to an engine over the channel: `register-part` calls
(engine.service.wire) of at most a part's size of weights each, read from disk one part at a
time and sent once the engine has stored the one before. No frame is larger than the engine's
frame limit, however large the adapter. An adapter over the engine's adapter limit (its `info`)
is refused (413 `file_too_large`) before any of it is read or sent.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from io import BufferedReader
from pathlib import Path

from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.engine.errors import EngineError, UnknownAdapterError
from loramux.gateway.engine_client.base import require_wire
from loramux.gateway.engine_client.channel import Channel

DELETED = "this adapter was deleted"
"""A request for an adapter whose files are gone: its delete reached this worker's store
before its catalog (up to its ttl): a 404, as from a fresh catalog, and the engine is not given
the digest again (a retired digest registered anew stayed in the engine for good)."""
PROBE_SECONDS = 5.0
PART_SECONDS, LAST_PART_SECONDS = 30.0, 300.0
"""How long a part's answer may take: the last one's comes once the engine has checked and
loaded the whole adapter, the first one's once another gateway's upload of it is done."""


async def adapter_limit(channel: Channel) -> int:
    """The largest adapter (config and weights) the channel's engine takes (its `info`,
    learned once per connection); EngineVersionError for an engine of another release."""
    endpoint = channel.endpoint
    if endpoint.max_adapter_bytes is None:
        info = require_wire(endpoint.url, await channel.call("info", PROBE_SECONDS))
        endpoint.max_adapter_bytes = int(info["max_adapter_bytes"])
    return endpoint.max_adapter_bytes


async def send_adapter(
    channel: Channel, digest: str, folder: Path, part_bytes: int, live: Callable[[str], bool]
) -> None:
    """Upload the adapter in `folder` as `digest`, in parts of `part_bytes` of weights; returns
    once the engine serves it. Typed errors as the engine raised them; FileTooLarge (nothing
    sent) over the engine's limit; UnknownAdapterError when the files are gone, or when the
    digest is no longer `live` once sent (retired meanwhile: its retire may have reached the
    engine before the upload, so it is retired there again, else the engine served it for
    good)."""
    limit = await adapter_limit(channel)
    config, weights = await asyncio.to_thread(_open_adapter, folder, limit, channel.endpoint.url)
    try:
        await _send_parts(channel, digest, config, weights, part_bytes)
    except BaseException as exc:
        channel.abort_upload(digest)  # cancelled or failed: the engine frees its share now
        if isinstance(exc, EngineError) and not live(digest):  # cancelled by its retire
            raise UnknownAdapterError(DELETED) from None
        raise
    finally:
        weights.close()
    if not live(digest):
        await channel.call("retire", PROBE_SECONDS, digest=digest)
        raise UnknownAdapterError(DELETED)


async def _send_parts(
    channel: Channel, digest: str, config: bytes, weights: BufferedReader, part_bytes: int
) -> None:
    """The adapter's `register-part` calls, each sent once the one before is answered; done
    early when one is answered with the digest (the engine serves it: another gateway's upload
    of it, which the first part waited for, came first)."""
    size, offset = os.fstat(weights.fileno()).st_size, 0
    while True:
        part = await asyncio.to_thread(weights.read, min(part_bytes, size - offset))
        if len(part) != min(part_bytes, size - offset):
            raise UnknownAdapterError(DELETED)  # its files changed under it
        last = offset + len(part) == size
        answer = await channel.call(
            "register-part",
            LAST_PART_SECONDS if last or offset == 0 else PART_SECONDS,
            digest=digest,
            config=config if offset == 0 else None,
            weights=part,
            offset=offset,
            size=size,
        )
        if last or answer == digest:
            return
        offset += len(part)


def _open_adapter(folder: Path, limit: int, url: str) -> tuple[bytes, BufferedReader]:
    """The adapter's config and its weights file, open; FileTooLarge (before either is read)
    when together they are over `limit`, UnknownAdapterError when they are gone."""
    try:
        weights = (folder / WEIGHTS_FILE).open("rb")
    except FileNotFoundError:  # deleted since a catalog (another worker's) resolved it
        raise UnknownAdapterError(DELETED) from None
    try:
        size = (folder / CONFIG_FILE).stat().st_size + os.fstat(weights.fileno()).st_size
        if size > limit:
            raise FileTooLarge(
                f"the adapter's files hold {size} bytes; engine {url} takes adapters of at most "
                f"{limit} bytes"
            )
        return (folder / CONFIG_FILE).read_bytes(), weights
    except FileNotFoundError:
        weights.close()
        raise UnknownAdapterError(DELETED) from None
    except BaseException:
        weights.close()
        raise
