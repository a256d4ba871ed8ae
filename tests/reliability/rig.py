"""The reliability suite's rig: a gateway on loopback, tenants made through the admin API, waiting
for a condition, reaching into the gateway's event loop to read its state, and a load during
which something fails and comes back (`drill`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loramux.gateway.db.migrate import upgrade
from loramux.gateway.server import RunningServer, engine_client, serve_in_thread
from loramux.gateway.settings import (
    CacheSettings,
    EngineSettings,
    QuotaSettings,
    ServerSettings,
    Settings,
)
from tests.gateway.tenants import new_tenant, upload_adapter
from tests.reliability.traffic import (
    OWN_ADAPTER,
    SHARED_ADAPTER,
    Outcome,
    Plan,
    Run,
    Tenant,
    run_load,
)

T = TypeVar("T")

GENEROUS_QUOTAS: dict[str, Any] = {
    "rpm": 1_000_000,
    "tpm": 2_000_000_000,
    "max_concurrent": 100_000,
    "token_budget": 10**12,
    "budget_period": "day",
}
"""Every kind of limit, none of which a test's load reaches: each request is checked and
reserved in Redis, none refused."""


# -- a gateway ---------------------------------------------------------------------------------
def gateway_settings(
    model_dir: Path,
    data_dir: Path,
    *,
    database_url: str | None = None,
    engine_urls: tuple[str, ...] = (),
    engine_token: str | None = None,
    quotas: QuotaSettings | None = None,
    redis_timeout_ms: int | None = None,
) -> Settings:
    """The reliability suite's gateway: the demo model, a small context and KV pool, a short
    key cache, quotas as given; `redis_timeout_ms` replaces the default time the quotas and the
    response cache wait for Redis."""
    if redis_timeout_ms is not None:
        quotas = dataclasses.replace(quotas or QuotaSettings(), redis_timeout_ms=redis_timeout_ms)
    return Settings(
        data_dir=data_dir,
        model=model_dir,
        engine=EngineSettings(max_model_len=512, kv_cache_mb=32),
        server=ServerSettings(
            database_url=database_url,
            model_name="demo-model",
            key_cache_seconds=0.5,
            engine_urls=engine_urls,
            engine_token=engine_token,
        ),
        quotas=quotas or QuotaSettings(),
        cache=CacheSettings(redis_timeout_ms=redis_timeout_ms)
        if redis_timeout_ms is not None
        else CacheSettings(),
    )


def serve(settings: Settings, redis_url: str) -> Any:
    """A migrated gateway on loopback (a context manager yielding RunningServer)."""
    upgrade(settings.database_url)
    assert settings.model is not None
    return serve_in_thread(
        settings, engine_client(settings, settings.model), settings.model, redis_url=redis_url
    )


def admin_client(server: RunningServer) -> httpx.Client:
    token = server.state.admin.mint("reliability", ttl_seconds=3600)
    return httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=120
    )


def make_tenants(
    admin: httpx.Client,
    count: int,
    adapter_dirs: Sequence[Path],
    quotas: dict[str, Any] | None = GENEROUS_QUOTAS,
) -> list[Tenant]:
    """`count` tenants with `quotas` (None: no limits), each owning an adapter named
    OWN_ADAPTER; plus one shared adapter (uploaded once per gateway)."""
    if admin.get(f"/admin/adapters/shared/{SHARED_ADAPTER}").status_code == 404:
        upload_adapter(admin, "shared", SHARED_ADAPTER, adapter_dirs[0])
    tenants = []
    for i in range(count):
        t = new_tenant(admin, f"soak{i}")
        if quotas is not None:
            r = admin.put(f"/admin/tenants/{t.tenant_id}/quotas", json=quotas)
            assert r.status_code == 200, r.text
        upload_adapter(admin, t.tenant_id, OWN_ADAPTER, adapter_dirs[1 + i])
        tenants.append(Tenant(t.tenant_id, t.key_id, t.key))
    return tenants


# -- waiting -----------------------------------------------------------------------------------
async def eventually(
    read: Callable[[], Awaitable[T]], holds: Callable[[T], bool], seconds: float
) -> T:
    """The first reading for which `holds` is true, or the last one once `seconds` passed."""
    deadline = time.monotonic() + seconds
    while True:
        value = await read()
        if holds(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


def on_gateway(server: RunningServer, coro: Awaitable[T]) -> Awaitable[T]:
    """Await `coro` on the gateway's event loop (its database and Redis clients live there)."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, server.loop))  # type: ignore[arg-type]


async def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` became true within `seconds` (checked every 50 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# -- a fault under load ------------------------------------------------------------------------
@dataclass
class Drill:
    """A load during which something failed and came back; outcomes are told apart by when
    their request started (after the fault; after recovery, once the part was back up)."""

    run: Run
    fault_at: float = 0.0
    recovered_at: float = 0.0
    outage_seen: bool = False
    """The outage showed in answers (as the test's `outage_seen` defines it)."""
    recovery_seen: bool = False
    """Requests started after recovery were answered whole again."""

    def since_fault(self) -> list[Outcome]:
        return [o for o in self.run.outcomes if o.started >= self.fault_at]

    def after(self) -> list[Outcome]:
        return [o for o in self.run.outcomes if o.started >= self.recovered_at]


async def drill(
    server: RunningServer,
    tenants: Sequence[Tenant],
    plans: Iterable[Plan],
    *,
    fault: Callable[[], None],
    outage_seen: Callable[[list[Outcome]], bool],
    recover: Callable[[], None],
    concurrency: int = 8,
) -> Drill:
    """Run `plans` against `server`; once requests flow, `fault()`; once `outage_seen` holds for
    the answers to requests started since (or 30 s passed), `recover()` (which returns once the
    part is back up); once 16 requests started after that are answered whole (or 90 s passed),
    stop the load. Every request must end within a bounded time: a hang fails the test here."""
    run = Run()
    stop = asyncio.Event()
    load = asyncio.create_task(
        run_load(server.url, tenants, plans, concurrency, run, stop, backoff=0.2)
    )
    d = Drill(run)
    try:
        await wait_for(lambda: len(run.outcomes) >= 2 * concurrency, 60)
        d.fault_at = time.monotonic()
        await asyncio.to_thread(fault)
        d.outage_seen = await wait_for(lambda: outage_seen(d.since_fault()), 30)
        await asyncio.to_thread(recover)
        d.recovered_at = time.monotonic()
        d.recovery_seen = await wait_for(lambda: sum(map(answered, d.after())) >= 16, 90)
    finally:
        stop.set()
        async with asyncio.timeout(150):  # the requests in flight end, one way or another
            await load
    return d


def answered(o: Outcome) -> bool:
    """Answered whole: 200, read to the end, with usage, no error inside the stream."""
    return o.status == 200 and o.done and o.usage is not None and o.stream_error is None


@dataclass(frozen=True)
class TenantsDrill:
    """A drill and the tenants whose traffic it ran."""

    drill: Drill
    tenants: list[Tenant]


def unanswered(at_least: int) -> Callable[[list[Outcome]], bool]:
    """An `outage_seen` for `drill`: `at_least` requests since the fault were not answered
    whole (a few more than the caches that answer for a moment after a part goes)."""
    return lambda outcomes: sum(not answered(o) for o in outcomes) >= at_least
