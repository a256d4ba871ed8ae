"""An adapter's files on their way to an engine over the channel: one `register` message, which
must fit the engine's message limit. The engine drops a connection that sends more, and with it
every stream of that gateway, whichever tenant's: so an adapter that would not fit is refused
(413 `file_too_large`) before its files are read.
"""

from __future__ import annotations

from pathlib import Path

from loramux.adapters.errors import FileTooLarge
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.engine.errors import UnknownAdapterError
from loramux.gateway.engine_client.channel import Channel
from loramux.gateway.engine_client.routing import Endpoint

DELETED = "this adapter was deleted"
"""A request for an adapter whose files are gone: its delete reached this worker's store
before its catalog (up to its ttl): a 404, as from a fresh catalog, and the engine is not given
the digest again (a retired digest registered anew stayed in the engine for good)."""
UPLOAD_ROOM = 64 << 10
"""What a register message holds besides the files: the token, ids and msgpack's framing."""
PROBE_SECONDS = 5.0


async def message_limit(endpoint: Endpoint, channel: Channel) -> int:
    """The largest message the engine at `endpoint` takes (its `info`; learned once per
    connection)."""
    if endpoint.max_message_bytes is None:
        info = await channel.call("info", PROBE_SECONDS)
        # An engine of an earlier release does not say; it took messages of up to 512 MiB.
        endpoint.max_message_bytes = int(info.get("max_message_bytes", 512 << 20))
    return endpoint.max_message_bytes


def read_adapter(folder: Path, limit: int, url: str) -> tuple[bytes, bytes]:
    """The adapter's config and weights, unless with the message around them they are over
    `limit` (FileTooLarge, before they are read), or gone (UnknownAdapterError)."""
    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    try:
        size = config.stat().st_size + weights.stat().st_size
    except FileNotFoundError:  # deleted since a catalog (another worker's) resolved it
        raise UnknownAdapterError(DELETED) from None
    if size + UPLOAD_ROOM > limit:
        raise FileTooLarge(
            f"the adapter's files hold {size} bytes; engine {url} takes adapters of at most "
            f"{limit - UPLOAD_ROOM} bytes (its message limit)"
        )
    return config.read_bytes(), weights.read_bytes()
