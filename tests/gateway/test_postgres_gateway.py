"""The gateway's SQL works on PostgreSQL: a second gateway on a real server, migrated by Alembic,
serves an operator's and a tenant's whole flow over HTTP."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from loramux.gateway.db import Tenant
from loramux.gateway.db import session as db_session
from loramux.gateway.errors import to_gateway_error
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter
from tests.gateway.test_adapter_files_lifecycle import publish_racing_owner_deletion


@pytest.fixture(scope="module")
def tenant(pg_admin: httpx.Client) -> TenantKey:
    return new_tenant(pg_admin, "pg")


def as_tenant(pg_gateway: RunningServer, tenant: TenantKey) -> httpx.Client:
    headers = {"authorization": f"Bearer {tenant.key}"}
    return httpx.Client(base_url=pg_gateway.url, headers=headers, timeout=120)


def usage_rows(pg_admin: httpx.Client, tenant_id: str, group_by: str) -> list[dict[str, Any]]:
    """The tenant's usage report, once the metering batch that holds its requests is written."""
    deadline = time.monotonic() + 30
    while True:
        response = pg_admin.get("/admin/usage", params={"tenant": tenant_id, "group_by": group_by})
        rows: list[dict[str, Any]] = json_of(response)["rows"]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_the_gateway_runs_on_the_migrated_postgresql_schema(pg_gateway: RunningServer) -> None:
    assert pg_gateway.state.db.dialect.name == "postgresql"


def test_a_new_key_lists_the_models_and_the_creation_is_audited(
    pg_gateway: RunningServer, pg_admin: httpx.Client, tenant: TenantKey
) -> None:
    with as_tenant(pg_gateway, tenant) as api:
        models = json_of(api.get("/v1/models"))
    assert "demo-model" in {m["id"] for m in models["data"]}
    audit = json_of(pg_admin.get("/admin/audit", params={"limit": 50}))["items"]
    assert {("tenant.create", tenant.tenant_id), ("key.create", tenant.key_id)} <= {
        (e["action"], e["target"]) for e in audit
    }


def test_a_completion_with_a_private_adapter_is_metered(
    pg_gateway: RunningServer,
    pg_admin: httpx.Client,
    tenant: TenantKey,
    demo_adapter_dirs: list[Path],
) -> None:
    adapter = upload_adapter(pg_admin, tenant.tenant_id, "pg-support", demo_adapter_dirs[3])
    assert (adapter["owner"], adapter["version"]) == (tenant.tenant_id, 1)
    body = {"model": "pg-support", "messages": [{"role": "user", "content": "Hi"}]}
    with as_tenant(pg_gateway, tenant) as api:
        response = api.post("/v1/chat/completions", json=body | {"max_tokens": 4})
    assert response.status_code == 200, response.text
    by_adapter = usage_rows(pg_admin, tenant.tenant_id, "adapter")
    assert [(r["group"], r["requests"]) for r in by_adapter] == [("pg-support", 1)]
    by_day = usage_rows(pg_admin, tenant.tenant_id, "day")
    assert [r["requests"] for r in by_day] == [1]


def test_usage_bills_the_adapter_however_long_the_name_a_request_gave_it(
    pg_gateway: RunningServer, pg_admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    """Usage records the adapter that answered, not the name a request gave it: `bot` and
    `<tenant name>/bot@000000001` are one adapter, billed in one row. Usage recorded the name
    as written, and with a tenant name of 200 characters it did not fit PostgreSQL's
    `usage_events.model` (22001): the recorder dropped the event, served but never billed."""
    name = f"long-{uuid.uuid4().hex[:10]}".ljust(200, "n")
    tenant_id = json_of(pg_admin.post("/admin/tenants", json={"name": name}))["id"]
    tenant = TenantKey(tenant_id, name, *new_key(pg_admin, tenant_id))
    upload_adapter(pg_admin, tenant_id, "bot", demo_adapter_dirs[3])
    dropped = pg_gateway.state.usage.dropped["refused"]
    completions = 0
    with as_tenant(pg_gateway, tenant) as api:
        for model in ("bot", f"{name}/bot@000000001"):
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
            response = api.post("/v1/chat/completions", json=body | {"max_tokens": 4})
            completions += json_of(response)["usage"]["completion_tokens"]
    pg_gateway.run(pg_gateway.state.usage.flush())
    assert pg_gateway.state.usage.dropped["refused"] == dropped
    by_adapter = usage_rows(pg_admin, tenant_id, "adapter")
    assert [(r["group"], r["requests"], r["completion_tokens"]) for r in by_adapter] == [
        ("bot", 2, completions)
    ]


def test_text_postgresql_cannot_store_is_the_clients_400(pg_gateway: RunningServer) -> None:
    """A value holding NUL that reaches PostgreSQL (a body's field no guard reads) is refused
    by it with 22021, and that is the client's 400, not a 500: the gateway had no mapping."""

    async def compare_with_nul() -> DBAPIError:
        async with pg_gateway.state.sessions() as session:
            try:
                await session.scalar(select(Tenant).where(Tenant.name == "a\x00b"))
            except DBAPIError as exc:
                return exc
        raise AssertionError("PostgreSQL compared text holding NUL")

    error = to_gateway_error(pg_gateway.run(compare_with_nul()))
    assert error is not None and (error.status, error.code) == (400, "invalid_request")


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
async def test_a_statement_the_database_does_not_answer_is_a_503(
    pg_gateway: RunningServer, postgres_url: str, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """A statement PostgreSQL does not answer (here: it waits on a lock another connection
    holds; a hung server or a cut-off network alike) waited forever, holding its request, or
    the usage flush, for good. asyncpg cancels it after STATEMENT_SECONDS, and the error is
    the database's 503, not a 500. A `postgres://` URL (many providers' spelling) got no
    bounds at all: they were given by the URL's backend name, "postgres" there."""
    monkeypatch.setattr(db_session, "STATEMENT_SECONDS", 0.5)
    url = make_url(postgres_url).set(drivername=scheme).render_as_string(hide_password=False)
    holder, waiter = db_session.create_engine(postgres_url), db_session.create_engine(url)
    try:
        async with holder.begin() as locked:
            await locked.execute(text("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE"))
            with pytest.raises(DBAPIError) as caught:
                async with waiter.connect() as reader:  # unbounded, it waited for good: fail
                    await asyncio.wait_for(reader.execute(select(Tenant.id).limit(1)), 60)
        error = to_gateway_error(caught.value)
        assert error is not None and (error.status, error.code) == (503, "database_unavailable")
        async with waiter.connect() as reader:  # the pool recovers once the lock is gone
            await reader.execute(select(Tenant.id).limit(1))
    finally:
        await holder.dispose()
        await waiter.dispose()


def test_a_revoked_key_is_refused(pg_gateway: RunningServer, pg_admin: httpx.Client) -> None:
    doomed = new_tenant(pg_admin, "pg-revoked")
    assert pg_admin.delete(f"/admin/keys/{doomed.key_id}").status_code == 200
    with as_tenant(pg_gateway, doomed) as api:
        assert api.get("/v1/models").status_code == 401


async def test_concurrent_first_quota_writes_all_apply(
    pg_gateway: RunningServer, pg_admin: httpx.Client
) -> None:
    paths = [f"/admin/tenants/{new_tenant(pg_admin, 'pg-race').tenant_id}/quotas" for _ in range(4)]
    writes = [{"rpm": 10}, {"tpm": 20}, {"max_concurrent": 30}] * 2
    async with httpx.AsyncClient(
        base_url=pg_gateway.url, headers=dict(pg_admin.headers), timeout=120
    ) as client:
        responses = await asyncio.gather(
            *(client.put(path, json=body) for path in paths for body in writes)
        )
    assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
    for path in paths:
        quota = json_of(pg_admin.get(path))
        assert (quota["rpm"], quota["tpm"], quota["max_concurrent"]) == (10, 20, 30)


def test_a_publish_whose_owner_is_deleted_meanwhile_is_refused_and_undone(
    pg_gateway: RunningServer,
    pg_admin: httpx.Client,
    demo_adapter_dirs: list[Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the tenant's row lock orders the two (tests/gateway/test_adapter_files_lifecycle)."""
    publish_racing_owner_deletion(pg_gateway, pg_admin, demo_adapter_dirs[18], monkeypatch)
