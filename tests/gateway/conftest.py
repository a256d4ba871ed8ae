"""A real gateway on loopback: uvicorn, SQLite, the in-process engine on the demo model; gateways
of their own on engine services (two; one behind a relay that can cut it); a second one on
PostgreSQL; and empty migrated databases (SQLite and PostgreSQL) for tests of the SQL
parts alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from tests.gateway.servers import ENGINE_TOKEN, TcpRelay, engine_service, gateway_server
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


@pytest.fixture
def two_engine_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[RunningEngineService], RunningServer]]:
    """A gateway of its own on two engine services (LORAMUX_ENGINE_URLS, in that order), for
    tests that stop one."""
    with (
        engine_service(demo_model_dir, tmp_path / "a") as a,
        engine_service(demo_model_dir, tmp_path / "b") as b,
    ):
        monkeypatch.setenv("LORAMUX_ENGINE_URLS", f"{a.url},{b.url}")
        monkeypatch.setenv("LORAMUX_ENGINE_TOKEN", ENGINE_TOKEN)
        with gateway_server(demo_model_dir, tmp_path / "gw", redis_url) as gw:
            yield [a, b], gw


@pytest.fixture
def relayed_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> Iterator[tuple[RunningServer, TcpRelay]]:
    """A gateway whose engine service is reached through a relay the test can cut."""
    with engine_service(demo_model_dir, tmp_path / "adapters") as service:
        relay = TcpRelay(int(service.url.rsplit(":", 1)[1]))
        try:
            with gateway_server(
                demo_model_dir,
                tmp_path / "data",
                redis_url,
                client=lambda _: RemoteEngineClient([relay.url], ENGINE_TOKEN),
            ) as gw:
                yield gw, relay
        finally:
            relay.close()


@pytest.fixture(scope="session")
def pg_gateway(
    postgres_url: str,
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
) -> Iterator[RunningServer]:
    """A gateway like `gateway`, on the session's PostgreSQL server migrated by Alembic."""
    upgrade(postgres_url)
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("postgres-gateway-data"),
        model=demo_model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=32),
        server=ServerSettings(database_url=postgres_url, model_name="demo-model"),
    )
    client = engine_client(settings, demo_model_dir)
    with serve_in_thread(settings, client, demo_model_dir, redis_url=redis_url) as server:
        yield server


@pytest.fixture(scope="module")
def pg_admin(pg_gateway: RunningServer) -> Iterator[httpx.Client]:
    """An HTTP client of `pg_gateway` carrying an admin token."""
    with admin_client(pg_gateway) as c:
        yield c


@pytest.fixture(params=["sqlite", "postgresql"])
def each_gateway(request: pytest.FixtureRequest) -> RunningServer:
    """The SQLite gateway, then the PostgreSQL one: for what must not depend on the database."""
    return request.getfixturevalue("gateway" if request.param == "sqlite" else "pg_gateway")


def admin_client(server: RunningServer) -> httpx.Client:
    """An HTTP client of `server` carrying an admin token of its own."""
    token = server.state.admin.mint("test-admin", ttl_seconds=3600)
    headers = {"authorization": f"Bearer {token}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


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
