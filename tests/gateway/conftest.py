"""A real gateway on loopback: uvicorn, SQLite, the in-process engine on the demo model; and
empty migrated databases (SQLite and PostgreSQL) for tests of the SQL parts alone."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, session_factory
from gateway.server import RunningServer, engine_client, serve_in_thread
from gateway.settings import Settings
from tests.migrations.test_revisions import new_postgres_database


@pytest.fixture(scope="session")
def gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("gateway-data")
    env = {
        "LORAMUX_DATA_DIR": str(data),
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "32",
        "LORAMUX_KEY_CACHE_SECONDS": "0.5",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = Settings()
        upgrade(settings.database_url)
        client = engine_client(settings, demo_model_dir)
        with serve_in_thread(settings, client, demo_model_dir, redis_url=redis_url) as server:
            yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
