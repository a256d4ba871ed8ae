"""The engine's uploads under way (engine.service.upload_parts), on their own: their files,
their bounds, and how they end."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.engine.errors import (
    AdapterUnavailableError,
    EngineOverloadedError,
    InvalidRequestError,
)
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
    rounds = [parts.receive(GATEWAY, DIGEST, b"{}", part, 0, 1 << 20) for _ in range(1000)]
    await asyncio.gather(*rounds, return_exceptions=True)
    await parts.settled()
    assert len(list(tmp_path.iterdir())) == 1  # the upload started last
    parts.close()
    assert list(tmp_path.iterdir()) == []


async def test_an_aborted_upload_frees_its_share_at_once(tmp_path: Path) -> None:
    """A gateway that gives an upload up (its request was cancelled) says so, and the upload
    is dropped with its files at once: it used to hold its share, locking other uploads out,
    until it was abandoned a minute later. Only the gateway sending it can abort it."""
    parts = UploadParts(tmp_path, 1000, 1000, max_gateway_bytes=1000)
    assert await parts.receive(GATEWAY, "a", b"{}", b"x" * 100, 0, 900) is None
    with pytest.raises(EngineOverloadedError):
        await parts.receive(b"other", "b", b"{}", b"y" * 100, 0, 900)
    parts.abort(b"other", "a")  # not its upload: nothing changes
    assert parts.reserved == 902
    parts.abort(GATEWAY, "a")
    assert parts.reserved == 0
    await parts.settled()
    assert list(tmp_path.iterdir()) == []
    assert await parts.receive(b"other", "b", b"{}", b"y" * 100, 0, 900) is None
    parts.close()


async def test_a_digest_under_way_is_waited_for_not_uploaded_twice(tmp_path: Path) -> None:
    """A second gateway uploading a digest another is uploading waits for that upload instead
    of taking a share of its own (five gateways missing one adapter after an engine restart
    took five shares, and the fifth was refused); a waiting first part its gateway aborted
    starts nothing once the other upload ends; a gateway's first parts waiting (each held in
    memory) are bounded as its uploads are."""
    parts = UploadParts(tmp_path, 1000, 1000, max_gateway_uploads=1)
    assert await parts.receive(GATEWAY, DIGEST, b"{}", b"x" * 100, 0, 200) is None
    waiting = asyncio.create_task(parts.wait_turn(b"second", DIGEST))
    aborted = asyncio.create_task(parts.wait_turn(b"third", DIGEST))
    await asyncio.sleep(0)
    with pytest.raises(EngineOverloadedError):  # one gateway's first parts waiting: bounded
        await parts.wait_turn(b"third", DIGEST)
    parts.abort(b"third", DIGEST)
    assert await parts.wait_turn(GATEWAY, DIGEST) is False  # its own: it goes on
    whole = await parts.receive(GATEWAY, DIGEST, None, b"x" * 100, 100, 200)
    assert whole is not None and parts.reserved == 202 and not waiting.done()
    parts.finish(DIGEST)  # registered
    assert await waiting is True
    with pytest.raises(InvalidRequestError):
        await aborted
    assert parts.reserved == 0
    parts.close()


async def test_uploads_under_way_are_bounded_in_number(tmp_path: Path) -> None:
    """However small, at most `max_uploads` uploads are under way on the engine, and at most
    `max_gateway_uploads` from one gateway; an adapter of empty weights is whole at once."""
    parts = UploadParts(tmp_path, 1000, 10_000, max_uploads=3, max_gateway_uploads=2)
    for gateway, digest in ((b"a", "1"), (b"a", "2"), (b"b", "3")):
        assert await parts.receive(gateway, digest, b"{}", b"", 0, 1) is None
    with pytest.raises(EngineOverloadedError):
        await parts.receive(b"a", "4", b"{}", b"", 0, 1)  # the gateway's bound
    with pytest.raises(EngineOverloadedError):
        await parts.receive(b"c", "4", b"{}", b"", 0, 1)  # the engine's bound
    parts.abort(b"a", "1")
    assert parts.reserved == 2 * 3
    whole = await parts.receive(b"c", "4", b"{}", b"", 0, 0)
    assert whole is not None and (whole / WEIGHTS_FILE).read_bytes() == b""
    parts.finish("4")
    parts.close()


async def test_every_aborted_first_part_waiting_starts_nothing(tmp_path: Path) -> None:
    """A gateway's two first parts of one digest, each aborted while waiting for another
    gateway's upload of it: both start nothing. A flag, not a count, let the second start an
    upload nobody continued, holding a share for a minute (found by attacking the uploads)."""
    parts = UploadParts(tmp_path, 1000, 1000)
    assert await parts.receive(GATEWAY, DIGEST, b"{}", b"x" * 100, 0, 200) is None
    first = asyncio.create_task(parts.wait_turn(b"second", DIGEST))
    await asyncio.sleep(0)
    parts.abort(b"second", DIGEST)
    again = asyncio.create_task(parts.wait_turn(b"second", DIGEST))
    await asyncio.sleep(0)
    parts.abort(b"second", DIGEST)
    parts.abort(GATEWAY, DIGEST)  # the upload they waited for ends
    for waiting in (first, again):
        with pytest.raises(InvalidRequestError):
            await waiting
    parts.close()


async def test_one_gateway_holds_at_most_its_share_and_only_while_it_sends_bytes(
    tmp_path: Path,
) -> None:
    """A gateway's uploads under way announce at most half of what the engine takes, so
    another gateway can still upload; and a part of no bytes (past the first) is refused: it
    kept an upload from being abandoned without adding to it (one gateway held the engine's
    whole budget for as long as it liked, found by attacking the uploads)."""
    parts = UploadParts(tmp_path, 1000, 2000)
    assert await parts.receive(GATEWAY, "a", b"{}", b"x", 0, 900) is None
    with pytest.raises(EngineOverloadedError):
        await parts.receive(GATEWAY, "b", b"{}", b"x", 0, 900)  # past its half
    assert await parts.receive(b"other", "c", b"{}", b"x", 0, 900) is None
    with pytest.raises(InvalidRequestError):
        await parts.receive(GATEWAY, "a", None, b"", 1, 900)
    assert parts.reserved == 902  # the empty part dropped its upload
    parts.close()


async def test_a_first_part_waits_for_another_upload_a_bounded_time(tmp_path: Path) -> None:
    """A first part waiting for another gateway's slow upload of its digest is answered as
    overloaded (retry) after `wait_seconds`, below the gateway's wait for an answer: it used to
    wait as long as the other upload took, and the gateway, timing out, marked a healthy engine
    down (found by attacking the uploads)."""
    parts = UploadParts(tmp_path, 1000, 1000)
    parts.wait_seconds = 0.05
    assert await parts.receive(GATEWAY, DIGEST, b"{}", b"x" * 100, 0, 200) is None
    with pytest.raises(EngineOverloadedError, match="retry"):
        await parts.wait_turn(b"second", DIGEST)
    assert parts.reserved == 202  # the upload under way goes on
    parts.close()


async def test_the_uploading_folder_is_emptied_once_never_under_another_upload(
    tmp_path: Path,
) -> None:
    """What the run's `.uploading` folder holds is removed when the uploads are set up, and
    nothing there is removed when an upload starts. The first of two uploads starting at once
    used to sweep the folder on a worker thread, after the second's thread had made its folder
    (driven in that order here): the second lost its files, its later parts were written
    nowhere and its last part was refused as a broken adapter (missing_config, a 400)."""
    root = tmp_path / ".uploading"
    (root / "left-over").mkdir(parents=True)
    parts = UploadParts(root, 1000, 1000)
    assert not root.exists()
    root.mkdir()
    second = Path(tempfile.mkdtemp(dir=root))  # as the second upload's `_create` makes it
    assert await parts.receive(GATEWAY, DIGEST, b"{}", b"x" * 10, 0, 20) is None
    assert second.is_dir() and len(list(root.iterdir())) == 2
    whole = await parts.receive(GATEWAY, DIGEST, None, b"x" * 10, 10, 20)
    assert whole is not None and (whole / WEIGHTS_FILE).read_bytes() == b"x" * 20
    parts.close()


async def test_an_upload_whose_files_went_missing_is_the_engine_s_failure(
    tmp_path: Path,
) -> None:
    """An upload under way whose files are gone from the engine's disk is refused as the
    engine's failure (adapter_unavailable: a 503 the gateway retries), and dropped: its parts
    used to be written nowhere, and the whole upload refused as the client's broken adapter."""
    parts = UploadParts(tmp_path, 1000, 1000)
    for gone in (WEIGHTS_FILE, CONFIG_FILE):
        assert await parts.receive(GATEWAY, DIGEST, b"{}", b"x" * 10, 0, 20) is None
        (folder,) = tmp_path.iterdir()
        (folder / gone).unlink()
        with pytest.raises(AdapterUnavailableError):
            await parts.receive(GATEWAY, DIGEST, None, b"x" * 10, 10, 20)
        assert parts.reserved == 0
        await parts.settled()
        assert list(tmp_path.iterdir()) == []
    parts.close()
