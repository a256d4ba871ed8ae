"""The shared adapter store (gateway.adapters.shared_store) on real SQLite and PostgreSQL: what
one gateway puts, a replica with an empty folder of its own fetches and gets byte for byte;
parts, repeated and concurrent puts, deletes, tampered rows and hostile digests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE
from loramux.adapters.store import AdapterMetadata, AdapterStore, StoredAdapter
from loramux.gateway.adapters import shared_store
from loramux.gateway.adapters.shared_store import FILES, SharedAdapterStore, TamperedAdapter
from loramux.gateway.db import AdapterFilePart
from loramux.gateway.db.migrate import upgrade
from tests.migrations.test_revisions import new_postgres_database

PART_BYTES = 4096
"""Small parts, so that every adapter file is cut into several."""


@pytest.fixture(params=["sqlite", "postgresql"])
async def shared(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[SharedAdapterStore]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        url = await asyncio.to_thread(
            new_postgres_database, request.getfixturevalue("postgres_url")
        )
    await asyncio.to_thread(upgrade, url)
    store = SharedAdapterStore.from_url(url, part_bytes=PART_BYTES)
    try:
        yield store
    finally:
        await store.close()


def local_store(root: Path, demo_model_dir: Path) -> AdapterStore:
    return AdapterStore(root, BaseModelSpec.from_model_dir(demo_model_dir))


@pytest.fixture
def uploaded(tmp_path: Path, demo_model_dir: Path, demo_adapter_dirs: list[Path]) -> StoredAdapter:
    """An adapter as a gateway stored it in its own folder."""
    return local_store(tmp_path / "gateway", demo_model_dir).put(demo_adapter_dirs[37])


async def parts(shared: SharedAdapterStore, digest: str) -> int:
    query = select(func.count()).where(AdapterFilePart.digest == digest)
    async with shared.engine.connect() as conn:
        return int(await conn.scalar(query) or 0)


async def test_a_replica_with_a_folder_of_its_own_fetches_what_a_gateway_put(
    shared: SharedAdapterStore, uploaded: StoredAdapter, tmp_path: Path, demo_model_dir: Path
) -> None:
    await shared.put(uploaded)
    replica = local_store(tmp_path / "replica", demo_model_dir)
    fetched = await shared.fetch(uploaded.digest, replica)
    assert fetched is not None and fetched.digest == uploaded.digest
    assert fetched.path.parent == replica.root
    for name in FILES:
        assert (fetched.path / name).read_bytes() == (uploaded.path / name).read_bytes()
    weights = (uploaded.path / FILES[1]).stat().st_size
    assert await parts(shared, uploaded.digest) >= 1 + weights // PART_BYTES
    assert await shared.fetch(uploaded.digest, replica) == fetched  # now local: no copy


FETCH_FOREVER = """
import asyncio, sys
from pathlib import Path
from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.store import AdapterStore
from loramux.gateway.adapters.shared_store import SharedAdapterStore

async def main(url, digest, model, root):
    shared = SharedAdapterStore.from_url(url)
    replica = AdapterStore(Path(root), BaseModelSpec.from_model_dir(Path(model)))
    while True:
        await shared.fetch(digest, replica)
        replica.delete(digest)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_replica_killed_mid_fetch_leaves_nothing_outside_its_own_folder(
    uploaded: StoredAdapter, tmp_path: Path, demo_model_dir: Path
) -> None:
    """A fetch's files are written in the replica's own folder (its store's staging area), so
    what a replica killed mid-fetch leaves goes with that folder (engine.adapter_folder sweeps
    a dead replica's folder). They used to be written to a folder of their own in the temporary
    folder, which a killed replica left there for good."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    await asyncio.to_thread(upgrade, url)
    shared = SharedAdapterStore.from_url(url)
    try:
        await shared.put(uploaded)
    finally:
        await shared.close()
    temp, replica = tmp_path / "tmp", tmp_path / "replica"
    temp.mkdir()
    args = [url, uploaded.digest, str(demo_model_dir), str(replica)]
    env = {**os.environ, "TMPDIR": str(temp)}
    child = subprocess.Popen([sys.executable, "-c", FETCH_FOREVER, *args], env=env)
    try:
        deadline = time.monotonic() + 120
        while not [*temp.glob("loramux-fetch-*"), *replica.glob(".incoming/fetch-*")]:
            assert child.poll() is None, "the fetching process failed"
            assert time.monotonic() < deadline, "no fetch under way within 120 s"
            await asyncio.sleep(0.001)
    finally:
        child.kill()
        child.wait()
    assert list(temp.iterdir()) == []


async def test_putting_a_digest_again_or_from_two_gateways_at_once_stores_it_once(
    shared: SharedAdapterStore, uploaded: StoredAdapter
) -> None:
    await shared.put(uploaded)
    once = await parts(shared, uploaded.digest)
    other = SharedAdapterStore(shared.engine, PART_BYTES)
    await asyncio.gather(shared.put(uploaded), other.put(uploaded), shared.put(uploaded))
    assert await parts(shared, uploaded.digest) == once


async def test_a_put_holds_about_one_part_in_memory_whatever_the_adapter_s_size(
    tmp_path: Path,
) -> None:
    """A put reads and inserts each file one part at a time. It read the whole weights file,
    then sliced it into copies: twice the adapter in memory, so a 512 MiB upload
    (LORAMUX_MAX_UPLOAD_MB) made a gateway hold over 1 GiB for each put under way."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    await asyncio.to_thread(upgrade, url)
    digest, part_bytes = "f" * 64, 1 << 20
    folder = tmp_path / digest
    folder.mkdir()
    (folder / CONFIG_FILE).write_text("{}")
    (folder / WEIGHTS_FILE).write_bytes(bytes(range(256)) * (16 * part_bytes // 256))
    stored = StoredAdapter(folder, AdapterMetadata(digest, 8, 16.0, False, 2.0, ("q",), 1, 0))
    shared = SharedAdapterStore.from_url(url, part_bytes)
    try:
        tracemalloc.start()
        try:
            await shared.put(stored)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert await parts(shared, digest) == 1 + 16  # no empty part after the last whole one
    finally:
        await shared.close()
    assert peak < 4 * part_bytes, f"a put of 16 parts peaked at {peak / part_bytes:.1f} parts"


async def test_a_deleted_or_never_stored_digest_cannot_be_fetched(
    shared: SharedAdapterStore, uploaded: StoredAdapter, tmp_path: Path, demo_model_dir: Path
) -> None:
    replica = local_store(tmp_path / "replica", demo_model_dir)
    assert await shared.fetch("0" * 64, replica) is None
    await shared.put(uploaded)
    await shared.delete(uploaded.digest)
    assert await parts(shared, uploaded.digest) == 0
    assert await shared.fetch(uploaded.digest, replica) is None
    assert replica.digests() == []


async def test_present_names_the_stored_digests_among_many(
    shared: SharedAdapterStore, uploaded: StoredAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What engine replicas ask every second (engine.ray_deployment): which of the digests they
    hold copies of are still stored; those not are retired there."""
    monkeypatch.setattr(shared_store, "PRESENT_BATCH", 3)  # several queries: batches add up
    await shared.put(uploaded)
    others = [f"{n:064x}" for n in range(7)]
    assert await shared.present([*others, uploaded.digest]) == {uploaded.digest}
    assert await shared.present([]) == set()
    await shared.delete(uploaded.digest)
    assert await shared.present([uploaded.digest]) == set()


async def test_bytes_changed_in_the_database_are_refused_and_leave_nothing_behind(
    shared: SharedAdapterStore, uploaded: StoredAdapter, tmp_path: Path, demo_model_dir: Path
) -> None:
    await shared.put(uploaded)
    async with shared.engine.begin() as conn:
        row = (
            await conn.execute(
                select(AdapterFilePart.part, AdapterFilePart.data).where(
                    AdapterFilePart.digest == uploaded.digest, AdapterFilePart.name == FILES[1]
                )
            )
        ).first()
        assert row is not None
        flipped = row.data[:-1] + bytes([row.data[-1] ^ 1])  # one bit of the weights
        await conn.execute(
            update(AdapterFilePart)
            .where(
                AdapterFilePart.digest == uploaded.digest,
                AdapterFilePart.name == FILES[1],
                AdapterFilePart.part == row.part,
            )
            .values(data=flipped)
        )
    replica = local_store(tmp_path / "replica", demo_model_dir)
    with pytest.raises(TamperedAdapter):
        await shared.fetch(uploaded.digest, replica)
    assert replica.digests() == []


@pytest.mark.parametrize(
    "digest", ["../../etc/passwd", "A" * 64, "0" * 63, "0" * 65, "", "0" * 64 + "\n", 2**70]
)
async def test_what_is_not_a_digest_is_refused(
    shared: SharedAdapterStore, digest: object, tmp_path: Path, demo_model_dir: Path
) -> None:
    with pytest.raises(ValueError):
        await shared.fetch(digest, local_store(tmp_path / "replica", demo_model_dir))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await shared.has(digest)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await shared.present([digest])  # type: ignore[list-item]
