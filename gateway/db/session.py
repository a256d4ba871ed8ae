"""The async engine and session factory for the configured database URL."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from loramux.gateway.setting_checks import ConfigError

log = logging.getLogger(__name__)
STATEMENT_SECONDS = 30.0
"""How long one statement may run on PostgreSQL before asyncpg cancels it. Without a bound, a
database that stops answering (hung, or cut off without a reset) held every request that reads
it, and the usage recorder's flush, for good; now they get 503 `database_unavailable`."""
CONNECT_SECONDS = 10.0
"""How long opening a connection to PostgreSQL may take (asyncpg's default is 60 s)."""
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")
"""Files SQLite keeps beside a database; it creates them with the database file's mode."""


def async_url(url: str) -> str:
    """Map plain URLs to their async drivers: sqlite → aiosqlite, postgresql → asyncpg."""
    if url.startswith("sqlite:"):
        return "sqlite+aiosqlite:" + url.removeprefix("sqlite:")
    if url.startswith(("postgresql:", "postgres:")):
        return "postgresql+asyncpg:" + url.split(":", 1)[1]
    return url


DATABASE_URLS = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE"


def check_database_url(url: str | None, variable: str) -> None:
    """ConfigError naming LORAMUX_`variable` when `url` (None: unset) is no SQLAlchemy URL, or
    names a database SQLAlchemy has no dialect for: found where the settings are read, not by
    a traceback once serve has started its redis-server and engine. The message never holds
    the URL, whose password make_url could not find in it."""
    if url is None:
        return
    try:
        make_url(async_url(url)).get_dialect()
    except NoSuchModuleError:
        scheme = url.partition(":")[0]
        raise ConfigError(
            f"LORAMUX_{variable} names a database SQLAlchemy does not know ({scheme!r}); "
            f"expected {DATABASE_URLS}"
        ) from None
    except (ArgumentError, ValueError):  # ValueError: a port that is no number
        raise ConfigError(
            f"LORAMUX_{variable} is not a database URL; expected {DATABASE_URLS}"
        ) from None


def url_for_logs(url: str) -> str:
    """`url` as a log line may show it: its password, if any, written `***`."""
    return make_url(url).render_as_string(hide_password=True)


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other URLs and in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(str(parsed.database))


def prepare_sqlite_file(url: str) -> None:
    """For a SQLite URL, create the database file (and its folder) readable by this user only,
    0600 (0700): it holds API-key hashes and every tenant's usage. An existing file, or a
    companion file, readable by others is tightened. Other URLs: nothing to do."""
    path = sqlite_file(url)
    if path is None:
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for file in (path, *(path.with_name(path.name + suffix) for suffix in SQLITE_COMPANIONS)):
        _owner_only(file)


def _owner_only(file: Path) -> None:
    try:
        mode = stat.S_IMODE(file.stat().st_mode)
        if mode & 0o077:
            file.chmod(mode & 0o700)
    except FileNotFoundError:
        return
    except PermissionError as exc:
        log.warning("%s is readable by other users and cannot be changed: %s", file, exc)


def create_engine(url: str) -> AsyncEngine:
    prepare_sqlite_file(url)
    # By the dialect the URL is run with: `postgres://` is PostgreSQL too (its backend name is not).
    driven = make_url(async_url(url))
    postgres = driven.get_backend_name() == "postgresql"
    bounds = {"timeout": CONNECT_SECONDS, "command_timeout": STATEMENT_SECONDS} if postgres else {}
    engine = create_async_engine(driven, pool_pre_ping=True, connect_args=bounds)
    event.listen(engine.sync_engine, "handle_error", _timeout_is_unavailable)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

    return engine


def _timeout_is_unavailable(context: ExceptionContext) -> None:
    """asyncpg raises a bare TimeoutError when a statement or a connection runs out of time,
    which no database error mapping knows (a 500): it is the database not answering, raised
    as the OperationalError that says so (`gateway.db.faults`: 503)."""
    error = context.original_exception
    if isinstance(error, TimeoutError):
        statement = context.statement or "connect"
        raise OperationalError(statement, context.parameters, error) from error


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
