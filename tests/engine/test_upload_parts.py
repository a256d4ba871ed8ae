"""The engine's uploads under way (engine.service.upload_parts), on their own: their files,
their bounds, and how they end."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loramux.engine.service.upload_parts import UploadParts

GATEWAY, DIGEST = b"gateway", "ab" * 32


async def test_uploads_started_anew_while_parts_are_written_leave_no_folder_behind(
    tmp_path: Path,
) -> None:
    """A part at offset 0 starts its upload anew while the previous part is still being
    written on a worker thread: the old folder used to be removed on the event loop meanwhile,
    the write created its file again, and the folder stayed until the engine stopped."""
    parts = UploadParts(tmp_path, max_adapter_bytes=1 << 30, max_partial_bytes=4 << 30)
    part = b"\x00" * (256 << 10)
    rounds = [parts.receive((GATEWAY, DIGEST), b"{}", part, 0, 1 << 20) for _ in range(1000)]
    await asyncio.gather(*rounds, return_exceptions=True)
    await parts.settled()
    assert len(list(tmp_path.iterdir())) == 1  # the upload started last
    parts.close()
    assert list(tmp_path.iterdir()) == []
