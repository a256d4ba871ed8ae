"""A real gateway on loopback: uvicorn, SQLite, the in-process engine on the demo model; and
empty migrated databases (SQLite and PostgreSQL) for tests of the SQL parts alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.server import RunningServer
from tests.gateway.servers import gateway_server
from tests.migrations.test_revisions import new_postgres_database


@pytest.fixture(scope="session")
def gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    with gateway_server(demo_model_dir, tmp_path_factory.mktemp("gateway-data"), redis_url) as s:
        yield s


@pytest.fixture(scope="session")
def admin_token(gateway: RunningServer) -> str:
    return gateway.state.admin.mint("test-admin", ttl_seconds=3600)


@pytest.fixture
def admin(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    """An HTTP client carrying the admin token."""
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=60
    ) as c:
        yield c


def json_of(response: httpx.Response) -> Any:
    assert response.headers.get("content-type", "").startswith("application/json"), response.text
    return response.json()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of the test's own: a SQLite file, or a database on the session's
    PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'usage.db'}"
    return new_postgres_database(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def sessions(empty_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """Sessions on a migrated, empty database."""
    await asyncio.to_thread(upgrade, empty_url)
    engine = create_engine(empty_url)
    yield session_factory(engine)
    await engine.dispose()
