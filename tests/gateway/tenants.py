"""Test helpers that set things up through the admin API, as an operator would."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.errors import GatewayError, NotFound
from loramux.gateway.state import GatewayState
from loramux.gateway.tenants.lookup import get_tenant
from loramux.gateway.tenants.service import TenantService


@dataclass(frozen=True)
class TenantKey:
    tenant_id: str
    tenant_name: str
    key_id: str
    key: str


def new_tenant(admin: httpx.Client, prefix: str = "t", **key_options: Any) -> TenantKey:
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    r = admin.post("/admin/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tenant = r.json()
    return TenantKey(tenant["id"], name, *new_key(admin, tenant["id"], **key_options))


def new_key(admin: httpx.Client, tenant_id: str, **options: Any) -> tuple[str, str]:
    r = admin.post(f"/admin/tenants/{tenant_id}/keys", json=options)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def upload_adapter(admin: httpx.Client, owner: str, name: str, folder: Path) -> dict[str, Any]:
    files = {
        "adapter_config": (
            "adapter_config.json",
            (folder / "adapter_config.json").read_bytes(),
            "application/json",
        ),
        "adapter_model": (
            "adapter_model.safetensors",
            (folder / "adapter_model.safetensors").read_bytes(),
            "application/octet-stream",
        ),
    }
    r = admin.post("/admin/adapters", data={"name": name, "owner": owner}, files=files)
    assert r.status_code == 201, r.text
    return r.json()


def tenant_service(gw: GatewayState, session: AsyncSession) -> TenantService:
    """The admin API's tenant service over `session`, composed as its router composes it."""
    adapters = AdapterService(
        session, gw.store, gw.engine, gw.catalog, gw.model_name, gw.shared_store
    )
    return TenantService(session, gw.keys, adapters, gw.cache)


async def delete_tenant(gw: GatewayState, ref: str) -> str:
    """Delete a tenant through the admin API's own services, in a session of its own; what
    the handler would have answered."""
    async with gw.sessions() as session:
        try:
            await tenant_service(gw, session).delete(ref)
        except NotFound:
            return "404"
        return "200"


Step = Callable[[AsyncSession], Awaitable[Any]]


async def after_its_delete(
    gw: GatewayState, ref: str, write: Step, read: Step | None = None
) -> str:
    """What `write` answers in a session that read the tenant (and what `read` reads) before
    another session deleted the tenant: the interleaving of two admin requests at once that
    locking the tenant makes safe. `200`, a gateway error's status and code, or `500` and the
    exception the handler would not have mapped."""
    async with gw.sessions() as session:
        # Referenced until `write` ran: the session's identity map holds only what is.
        held = [await get_tenant(session, ref), await read(session) if read else None]
        assert await delete_tenant(gw, ref) == "200"
        try:
            await write(session)
        except GatewayError as exc:
            return f"{exc.status} {exc.code}"
        except Exception as exc:
            return f"500 {type(exc).__name__}"
        finally:
            del held
        return "200"
