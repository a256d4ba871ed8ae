"""The async engine and session factory for the configured database URL."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


def async_url(url: str) -> str:
    """Map plain URLs to their async drivers: sqlite → aiosqlite, postgresql → asyncpg."""
    if url.startswith("sqlite:"):
        return "sqlite+aiosqlite:" + url.removeprefix("sqlite:")
    if url.startswith(("postgresql:", "postgres:")):
        return "postgresql+asyncpg:" + url.split(":", 1)[1]
    return url


def create_engine(url: str) -> AsyncEngine:
    engine = create_async_engine(async_url(url), pool_pre_ping=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(conn: Any, _record: Any) -> None:
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=5000")
            cur.close()

    return engine


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
