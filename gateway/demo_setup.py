"""First start on embedded defaults: a demo tenant with a key (printed once) and shared demo
adapters; a first start that was stopped midway is finished by the next start. A database has
one first start, marked in it (`first_start`), whatever tenants it holds later; one that holds
tenants but no mark is in use already, and is marked with nothing made."""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.engine.errors import EngineStoppedError
from loramux.gateway.audit.service import OK, AuditLog
from loramux.gateway.auth.api_keys import NewKey, mint_key
from loramux.gateway.db import ApiKey, FirstStart, Tenant
from loramux.gateway.db.first_start import FIRST_START_ROW
from loramux.gateway.state import GatewayState

log = logging.getLogger(__name__)


FIRST_START = "first-start"
"""The audit log's actor for what a first start does."""
PENDING = "first-start.pending"
"""In the data directory from before the demo tenant is created until the demo adapters are
uploaded: a start that finds it finishes what a stopped first start left undone."""


async def first_start(gw: GatewayState, model_dir: Path, url: str) -> None:
    """On a database whose first start was not done (no `FirstStart` mark, and no tenant:
    `_claim`), create tenant `demo` and its key and print the key (once, with an example request to `url`, where serve
    listens) right after the commit; then, with the demo model, upload shared demo adapters,
    which takes seconds each. A first start stopped before its end (SIGTERM while uploading)
    left a tenant whose key nobody had seen; now the key is shown first, and the next start
    finds PENDING and uploads the adapters (an upload of the same bytes answers the version
    already there), so no start leaves a half-made first start. With no engine answering (an
    external one not up yet) the adapters wait for the next start likewise."""
    pending = gw.settings.data_dir / PENDING
    names = _demo_adapter_names(gw)
    async with gw.sessions() as session:
        done = await session.get(FirstStart, FIRST_START_ROW) is not None
    if done:
        if not pending.exists():
            return
        log.info("finishing the first start, which was stopped before it ended")
    else:
        key = await _create_demo_tenant(gw, pending)
        if key is None:  # another gateway on this database made it, or it is in use
            return
        _print_key(key, [gw.model_name, *names], url)
    if names:
        try:
            await _upload_demo_adapters(gw, model_dir, len(names))
        except EngineStoppedError as exc:  # an external engine not up yet: serve degraded
            log.warning("the demo adapters are uploaded at the next start: %s", exc)
            return
    pending.unlink(missing_ok=True)


def _demo_adapter_names(gw: GatewayState) -> list[str]:
    """The shared demo adapters of a first start: only with the demo model."""
    count = gw.settings.server.demo_adapters if gw.settings.model is None else 0
    return [f"demo-{i}" for i in range(count)]


async def _create_demo_tenant(gw: GatewayState, pending: Path) -> NewKey | None:
    """Tenant `demo` and its API key, committed together with the first start's mark, and
    audited (actor `first-start`) as an admin's `tenant.create` and `key.create`: the key's
    secret is in the result only (the database keeps its hash). None, with nothing made, when
    another gateway on this database claimed the first start, or the database is in use
    (`_claim`); PENDING is made once this one has."""
    key = mint_key()
    audit_log = AuditLog(gw.sessions)
    async with gw.sessions() as session:
        if not await _claim(session):
            return None  # closing the session rolls back what it left open
        pending.touch()
        async with audit_log.audited(FIRST_START, "tenant.create") as entry:
            entry.detail = {"name": "demo"}
            tenant = Tenant(name="demo")
            session.add(tenant)
            await session.flush()
            entry.target = tenant_id = tenant.id
            session.add(
                ApiKey(id=key.id, tenant_id=tenant_id, name="demo", secret_hash=key.secret_hash)
            )
            await session.commit()
    await audit_log.write(FIRST_START, "key.create", key.id, OK, {"tenant_id": tenant_id})
    return key


async def _claim(session: AsyncSession) -> bool:
    """Insert the first start's mark, first in the session's transaction (left open); False when
    another gateway's is there. Gateways starting together on a new database (compose's
    `--scale gateway=N`) all see no mark: the first insert holds the others' (PostgreSQL's
    primary key, SQLite's write lock) until its transaction ends, and once it commits theirs
    fail here, instead of their tenant `demo` breaking the unique name and their start.

    False too, with the mark committed, when the database holds tenants: it is in use (migrated
    and run without serve, by `loramux ray-serve`), and has had its first start, as the
    migration that added the mark holds. A tenant `demo` was made there, unasked, or, when an
    operator had one, broke the unique name and every start of serve."""
    session.add(FirstStart(id=FIRST_START_ROW))
    try:
        await session.flush()
    except IntegrityError:
        return False
    if await session.scalar(select(Tenant.id).limit(1)) is not None:
        await session.commit()
        log.info("the database holds tenants already: no demo tenant is made")
        return False
    return True


def _print_key(key: NewKey, models: list[str], url: str) -> None:
    """The demo key, its only showing, with an example request for the first adapter (the
    base model without one)."""
    model = models[1] if len(models) > 1 else models[0]
    print(
        f"\nloramux: created tenant 'demo' with API key (shown once):\n\n    {key.key}\n\n"
        f"models: {', '.join(models)}\ntry:\n"
        f"    curl {url}/v1/chat/completions -H 'Authorization: Bearer {key.key}' "
        f"-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "hello"}}]}}\'\n',
        flush=True,
    )


async def _upload_demo_adapters(gw: GatewayState, model_dir: Path, count: int) -> list[str]:
    from loramux.adapters.demo import build_demo_adapters
    from loramux.gateway.adapters.service import AdapterService

    folders = build_demo_adapters(model_dir, gw.settings.data_dir / "demo-adapters", count)
    audit_log = AuditLog(gw.sessions)
    names = []
    for i, folder in enumerate(folders):
        name = f"demo-{i}"
        async with gw.sessions() as session:
            adapters = AdapterService(
                session, gw.store, gw.engine, gw.catalog, gw.model_name, gw.shared_store
            )
            target = f"shared/{name}"
            async with audit_log.audited(FIRST_START, "adapter.upload", target) as entry:
                await adapters.check_name_and_owner(name, "shared")
                adapter = (await adapters.publish("shared", name, folder)).adapter
                entry.detail = {"version": adapter.version, "digest": adapter.digest}
        names.append(name)
    return names
