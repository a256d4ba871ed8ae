"""The first start of `loramux serve` on embedded defaults (gateway.demo_setup): tenant `demo`,
its API key shown once, and shared demo adapters; a first start stopped midway is finished by
the next start, never left half made."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import delete, func, select

from loramux.gateway.admin.paging import Paging
from loramux.gateway.audit.service import AuditLog
from loramux.gateway.db import AdapterVersion, ApiKey, FirstStart, Tenant
from loramux.gateway.db.adapter import SHARED_OWNER
from loramux.gateway.db.first_start import FIRST_START_ROW
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.demo_setup import PENDING, first_start
from loramux.gateway.server import engine_client
from loramux.gateway.settings import EngineSettings, ServerSettings, Settings
from loramux.gateway.state import GatewayState, build_state
from tests.migrations.test_revisions import new_postgres_database

URL = "http://127.0.0.1:46815"


@pytest.fixture
async def demo_state(
    tmp_path: Path, demo_model_dir: Path, redis_url: str
) -> AsyncIterator[GatewayState]:
    """A gateway's state as serve builds it on embedded defaults: the demo model in the data
    directory (LORAMUX_MODEL unset), two demo adapters to upload on first start."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "demo-model").symlink_to(demo_model_dir)
    settings = Settings(
        data_dir=data,
        model=None,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=16),
        server=ServerSettings(demo_adapters=2),
    )
    await asyncio.to_thread(upgrade, settings.database_url)
    client = engine_client(settings, settings.model_dir)
    state = await build_state(settings, client, settings.model_dir, redis_url)
    yield state
    await state.close()


class StopAtTheKey(io.StringIO):
    """Standard output that cancels `task` (a first start) as soon as a key is written to it:
    as a SIGTERM right after the key was shown cancels serve's start."""

    task: asyncio.Task[None] | None = None

    def write(self, text: str) -> int:
        if "lmx-" in text and self.task is not None:
            self.task.cancel()
        return super().write(text)


async def _demo_adapters(gw: GatewayState) -> list[tuple[str, int]]:
    async with gw.sessions() as session:
        rows = await session.execute(
            select(AdapterVersion.name, AdapterVersion.version)
            .where(AdapterVersion.owner == SHARED_OWNER)
            .order_by(AdapterVersion.name)
        )
        return [(name, version) for name, version in rows]


async def test_the_key_is_shown_before_the_adapters_and_a_stopped_first_start_is_finished(
    demo_state: GatewayState,
) -> None:
    """The key was printed only after the demo adapters' upload (seconds each): a SIGTERM
    meanwhile left tenant `demo` with a key nobody saw, and every later start did nothing since
    a tenant existed."""
    out = StopAtTheKey()
    with contextlib.redirect_stdout(out):
        out.task = asyncio.create_task(first_start(demo_state, demo_state.settings.model_dir, URL))
        with pytest.raises(asyncio.CancelledError):
            await out.task
    [key] = set(re.findall(r"lmx-[\w.-]+", out.getvalue()))
    assert f"curl {URL}/v1/chat/completions" in out.getvalue()
    assert await _demo_adapters(demo_state) == []  # the key came first
    assert (await demo_state.keys.authenticate(f"Bearer {key}")).tenant_name == "demo"

    again = io.StringIO()
    with contextlib.redirect_stdout(again):
        await first_start(demo_state, demo_state.settings.model_dir, URL)
    assert "lmx-" not in again.getvalue()  # the key is shown once
    assert await _demo_adapters(demo_state) == [("demo-0", 1), ("demo-1", 1)]


async def test_with_no_engine_answering_the_first_start_shows_the_key_and_leaves_the_adapters(
    tmp_path: Path, demo_model_dir: Path, redis_url: str
) -> None:
    """An external engine not up yet: the gateway starts degraded, its first start shows the key
    and leaves the demo adapters for the next start, instead of ending serve's start with the
    engine's error."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "demo-model").symlink_to(demo_model_dir)
    settings = Settings(
        data_dir=data,
        model=None,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=16),
        server=ServerSettings(demo_adapters=2, engine_urls=(f"ipc://{tmp_path / 'none.sock'}",)),
    )
    await asyncio.to_thread(upgrade, settings.database_url)
    client = engine_client(settings, settings.model_dir)
    state = await build_state(settings, client, settings.model_dir, redis_url)
    try:
        assert (state.model_name, state.max_model_len) == ("demo-model", 512)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            await first_start(state, settings.model_dir, URL)
        assert "lmx-" in out.getvalue()
        assert await _demo_adapters(state) == []
        assert (data / PENDING).exists()  # the next start uploads them
    finally:
        await state.close()


async def test_the_first_starts_tenant_key_and_adapters_are_audited(
    demo_state: GatewayState,
) -> None:
    """The first start's actions are audited like an admin's, as actor `first-start`: tenant
    `demo` and its unrestricted key (a credential) too, not only the demo adapters."""
    with contextlib.redirect_stdout(io.StringIO()):
        await first_start(demo_state, demo_state.settings.model_dir, URL)
    async with demo_state.sessions() as session:
        tenant_id = await session.scalar(select(Tenant.id).where(Tenant.name == "demo"))
        key_id = await session.scalar(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id))
    rows, _ = await AuditLog(demo_state.sessions).recent(Paging(50, 0, None))
    seen = [(r.actor, r.action, r.target, r.outcome, r.detail) for r in reversed(rows)]
    assert seen[:2] == [
        ("first-start", "tenant.create", tenant_id, "ok", {"name": "demo"}),
        ("first-start", "key.create", key_id, "ok", {"tenant_id": tenant_id}),
    ]
    assert [(a, t) for _, a, t, _, _ in seen[2:]] == [
        ("adapter.upload", "shared/demo-0"),
        ("adapter.upload", "shared/demo-1"),
    ]


async def test_a_deleted_demo_tenant_is_not_made_again_at_the_next_start(
    demo_state: GatewayState,
) -> None:
    """The first start went by an empty tenants table: an operator who deleted tenant `demo`
    (its key had gone to the logs) got it back at the next restart, with a new live key
    printed to the logs again."""
    with contextlib.redirect_stdout(io.StringIO()):
        await first_start(demo_state, demo_state.settings.model_dir, URL)
    async with demo_state.sessions() as session, session.begin():
        await session.execute(delete(Tenant).where(Tenant.name == "demo"))
    again = io.StringIO()
    with contextlib.redirect_stdout(again):
        await first_start(demo_state, demo_state.settings.model_dir, URL)
    assert "lmx-" not in again.getvalue()
    async with demo_state.sessions() as session:
        assert await session.scalar(select(func.count()).select_from(Tenant)) == 0


@pytest.fixture(params=["sqlite", "postgresql"])
async def two_gateways(
    request: pytest.FixtureRequest, tmp_path: Path, demo_model_dir: Path, redis_url: str
) -> AsyncIterator[list[GatewayState]]:
    """Two gateways on one migrated database, as compose runs them (`--scale gateway=2`): an
    external engine (not answering: irrelevant here), LORAMUX_MODEL set (so no demo adapters,
    only tenant `demo` and its key)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.db'}"
    else:
        server = request.getfixturevalue("postgres_url")
        url = await asyncio.to_thread(new_postgres_database, server)
    await asyncio.to_thread(upgrade, url)
    states = []
    for i in range(2):
        data = tmp_path / f"gateway-{i}"
        data.mkdir()
        settings = Settings(
            data_dir=data,
            model=demo_model_dir,
            engine=EngineSettings(max_model_len=512, kv_cache_mb=16),
            server=ServerSettings(
                database_url=url, engine_urls=(f"ipc://{tmp_path / 'no-engine.sock'}",)
            ),
        )
        client = engine_client(settings, demo_model_dir)
        states.append(await build_state(settings, client, demo_model_dir, redis_url))
    yield states
    for state in states:
        await state.close()


async def test_gateways_starting_together_on_a_new_database_make_one_demo_tenant(
    two_gateways: list[GatewayState],
) -> None:
    """Both saw no tenant and both inserted tenant `demo`: the second's insert broke the unique
    name and its start failed with an IntegrityError (compose restarted it)."""
    for gw in two_gateways:  # each with its pool's connection open, as a gateway that started
        async with gw.sessions() as session:
            await session.scalar(select(func.count()).select_from(Tenant))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        await asyncio.gather(*(first_start(gw, gw.settings.model_dir, URL) for gw in two_gateways))
    async with two_gateways[1].sessions() as session:
        assert list(await session.scalars(select(Tenant.name))) == ["demo"]
    assert len(set(re.findall(r"lmx-[\w.-]+", out.getvalue()))) == 1


@pytest.mark.parametrize("name", ["demo", "acme"])
async def test_a_database_in_use_without_the_mark_is_marked_and_given_no_demo_tenant(
    two_gateways: list[GatewayState], name: str
) -> None:
    """A database migrated empty and used without serve (`loramux ray-serve` runs no first
    start) holds tenants and no mark. serve on it added tenant `demo`, its key printed, to a
    database in use; where an admin had named a tenant `demo`, the unique name raised an
    IntegrityError out of every start. The migration that added the mark holds that a database
    with tenants has had its first start; so does serve now."""
    admins, starting = two_gateways
    async with admins.sessions() as session, session.begin():
        session.add(Tenant(name=name))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        await first_start(starting, starting.settings.model_dir, URL)
    assert "lmx-" not in out.getvalue()
    async with starting.sessions() as session:
        assert list(await session.scalars(select(Tenant.name))) == [name]
        assert await session.get(FirstStart, FIRST_START_ROW) is not None
    assert not (starting.settings.data_dir / PENDING).exists()
