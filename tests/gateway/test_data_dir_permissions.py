"""The data directory, the SQLite database (key hashes, usage) and the admin secret are readable
by their owner only, however they come to be created, under the usual umask 022."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from loramux.gateway.cli import ensure_model, main
from loramux.gateway.db import Tenant
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.settings import Settings


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def usual_umask() -> Iterator[None]:
    """The common umask, under which files are created world-readable unless asked not to be."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_new_sqlite_database_its_folder_and_its_wal_are_owner_only(tmp_path: Path) -> None:
    db = tmp_path / "fresh" / "nested" / "loramux.db"
    upgrade(f"sqlite:///{db}")
    assert (mode(db.parent), mode(db)) == (0o700, 0o600)
    assert asyncio.run(companion_modes_while_writing(db)) == [0o600, 0o600]


async def companion_modes_while_writing(db: Path) -> list[int]:
    """The modes of the -wal and -shm files SQLite keeps beside `db` while the gateway writes
    to it (they are removed when the last connection closes)."""
    engine = create_engine(f"sqlite:///{db}")
    try:
        async with session_factory(engine)() as session:
            session.add(Tenant(name="a tenant"))
            await session.commit()
            return [mode(db.with_name(db.name + suffix)) for suffix in ("-wal", "-shm")]
    finally:
        await engine.dispose()


def test_an_existing_database_readable_by_others_is_tightened(tmp_path: Path) -> None:
    db = tmp_path / "loramux.db"
    upgrade(f"sqlite:///{db}")
    db.chmod(0o644)
    upgrade(f"sqlite:///{db}")
    assert mode(db) == 0o600


@pytest.mark.parametrize("command", [["admin-token"], ["migrate"]])
def test_the_cli_creates_the_data_dir_and_its_files_owner_only(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(data))
    main(command)
    capsys.readouterr()
    assert mode(data) == 0o700
    created = data / ("admin_secret" if command == ["admin-token"] else "loramux.db")
    assert mode(created) == 0o600


def test_first_start_creates_the_data_dir_owner_only(tmp_path: Path, demo_model_dir: Path) -> None:
    data = tmp_path / "data"
    assert ensure_model(Settings(data_dir=data, model=demo_model_dir)) == demo_model_dir
    assert mode(data) == 0o700


def test_a_migrated_sqlite_database_is_in_wal_mode_before_any_gateway_connects(
    tmp_path: Path,
) -> None:
    """Gateways starting side by side then find WAL set: two connections switching a new
    database to it at once can fail at once with "database is locked" (no busy wait)."""
    db = tmp_path / "loramux.db"
    upgrade(f"sqlite:///{db}")
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)

    async def connect_at_once() -> None:
        engines = [create_engine(f"sqlite:///{db}") for _ in range(4)]
        try:
            await asyncio.gather(*(_first_connection(e) for e in engines))
        finally:
            await asyncio.gather(*(e.dispose() for e in engines))

    for _ in range(10):
        asyncio.run(connect_at_once())


async def _first_connection(engine: Any) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
