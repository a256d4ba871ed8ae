"""Bring a database to the models' schema with the Alembic revisions in `migrations/`.

Alembic is configured in code (no alembic.ini), so these work from any working directory. They
run their own event loop: call them from synchronous code, before the gateway's loop starts, and
from one thread at a time (Alembic's migration context is process-global).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from loramux import migrations
from loramux.gateway.db.session import async_url, prepare_sqlite_file, sqlite_file
from loramux.gateway.setting_checks import StartError

T = TypeVar("T")


def alembic_config(url: str) -> Config:
    """Alembic's configuration for the database at `url` (read by migrations/env.py)."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["url"] = url
    return config


def upgrade(url: str) -> None:
    """Migrate to the newest revision (a StartError, changing nothing, when the database is
    newer than this release). Idempotent: at head already, nothing changes, so this is
    safe on every start; concurrent callers take turns (`migrations/env.py`: PostgreSQL's
    advisory lock, or `sqlite_migration_lock`).

    A SQLite file is created owner-only first (`prepare_sqlite_file`), and switched to WAL
    once migrated (`use_wal`)."""
    prepare_sqlite_file(url)
    config = alembic_config(url)
    _refuse_unknown_revision(url, ScriptDirectory.from_config(config))
    command.upgrade(config, "head")
    use_wal(url)


def _refuse_unknown_revision(url: str, scripts: ScriptDirectory) -> None:
    """A StartError when the database is at a revision none of `scripts` is: a newer release
    migrated it (an operator rolled the release back). Alembic could only say, in a traceback,
    that it cannot locate it; and this release's code would misread the newer schema."""
    revision = current(url)
    if revision is None or revision in {script.revision for script in scripts.walk_revisions()}:
        return
    raise StartError(
        f"the database is at revision {revision}, newer than this release (whose newest is "
        f"{scripts.get_current_head()}): run the release that migrated it, or restore the "
        "database from before that migration"
    )


def use_wal(url: str, attempts: int = 50) -> None:
    """Switch a SQLite database to write-ahead logging, which it keeps. Done here, once, so
    that the gateway's connections (which ask for it too) find it done: two connections
    switching a new database at once can fail with "database is locked" at once, without
    waiting, as SQLite avoids a deadlock; the one that lost tries again here."""
    path = sqlite_file(url)
    if path is None:
        return
    for attempt in range(attempts):
        connection = sqlite3.connect(path, timeout=5)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
        finally:
            connection.close()
        time.sleep(0.01 * (attempt + 1))


@contextlib.contextmanager
def sqlite_migration_lock(url: str) -> Iterator[None]:
    """For a SQLite file, an exclusive flock on `<file>-migrations.lock` beside it, held while
    the block runs: gateways starting together on a new database (a shared volume) migrate
    one at a time, as PostgreSQL's advisory lock makes them, and those that waited find it at
    head; without it all but one failed, "table tenants already exists". Other URLs, and
    in-memory SQLite (no other process can open it), take no lock."""
    path = sqlite_file(url)
    if path is None:
        yield
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(path.with_name(path.name + "-migrations.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # which releases the flock


def downgrade(url: str, revision: str) -> None:
    """Migrate down to `revision` (`base`: drop every table)."""
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The database's revision; None before the first migration."""
    return with_connection(url, lambda c: MigrationContext.configure(c).get_current_revision())


def with_connection(url: str, work: Callable[[Connection], T]) -> T:
    """`work(connection)` on a synchronous facade of a fresh async connection to `url`; what
    `work` leaves uncommitted is rolled back when the connection closes."""

    async def run() -> T:
        engine = create_async_engine(async_url(url), poolclass=pool.NullPool)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(work)
        finally:
            await engine.dispose()

    return asyncio.run(run())
