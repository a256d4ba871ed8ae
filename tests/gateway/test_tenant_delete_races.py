"""A tenant deleted while other admin requests on it are under way: each of them, and a
second delete, is answered 200 or 404 (never 500), and nothing of the tenant is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from loramux.gateway.auth.api_keys import mint_key
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import NotFound, to_gateway_error
from loramux.gateway.keys.schemas import KeyCreate
from loramux.gateway.keys.service import KeyService
from loramux.gateway.server import RunningServer
from loramux.gateway.state import GatewayState
from loramux.gateway.tenants.lookup import get_tenant
from loramux.gateway.tenants.schemas import TenantUpdate
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.tenants import after_its_delete, delete_tenant, tenant_service
from tests.gateway.test_admin_tenants import new_key, unique


def test_two_deletes_of_one_tenant_at_once_are_one_200_and_one_404(
    each_gateway: RunningServer,
) -> None:
    """Both read the tenant before either locked it; the one that locked second found the row
    gone and still answered 200 (or failed on a row it could not delete), where a delete of a
    tenant that is not there is a 404."""
    gateway, admin = each_gateway, admin_client(each_gateway)
    for _ in range(3):
        tenant = json_of(admin.post("/admin/tenants", json={"name": unique("twice")}))

        assert sorted(gateway.run(_delete_twice(gateway.state, tenant["id"]))) == ["200", "404"]


async def _delete_twice(gw: GatewayState, ref: str) -> list[str]:
    return list(await asyncio.gather(delete_tenant(gw, ref), delete_tenant(gw, ref)))


def test_a_patch_of_a_tenant_deleted_meanwhile_is_404(each_gateway: RunningServer) -> None:
    """It wrote the row it had read after the delete removed it: StaleDataError, a 500."""
    gateway, admin = each_gateway, admin_client(each_gateway)
    tenant = json_of(admin.post("/admin/tenants", json={"name": unique("patched")}))

    def patch(session: AsyncSession) -> Any:
        return tenant_service(gateway.state, session).update(
            tenant["id"], TenantUpdate(disabled=True)
        )

    outcome = gateway.run(after_its_delete(gateway.state, tenant["id"], patch))

    assert outcome == "404 tenant_not_found"


def test_patches_racing_their_tenants_delete_are_200_or_404(each_gateway: RunningServer) -> None:
    gateway, admin = each_gateway, admin_client(each_gateway)
    for _ in range(3):
        tenant = json_of(admin.post("/admin/tenants", json={"name": unique("racing")}))

        patch, delete = gateway.run(_patch_and_delete(gateway.state, tenant["id"]))

        assert (patch, delete) in (("200", "200"), ("404", "200"))


async def _patch_and_delete(gw: GatewayState, ref: str) -> list[str]:
    async def patch() -> str:
        async with gw.sessions() as session:
            try:
                await tenant_service(gw, session).update(ref, TenantUpdate(disabled=True))
            except NotFound:
                return "404"
            return "200"

    return list(await asyncio.gather(patch(), delete_tenant(gw, ref)))


def test_a_key_made_or_revoked_for_a_tenant_deleted_meanwhile_is_404(
    each_gateway: RunningServer,
) -> None:
    """The new key's INSERT failed its foreign key (SQLite's "FOREIGN KEY constraint failed",
    PostgreSQL's 23503), and the revoke's UPDATE matched no row: 500s."""
    gateway, admin = each_gateway, admin_client(each_gateway)
    made = json_of(admin.post("/admin/tenants", json={"name": unique("keyed")}))
    revoked = json_of(admin.post("/admin/tenants", json={"name": unique("keyed")}))
    key = new_key(admin, revoked["id"])

    def make(session: AsyncSession) -> Any:
        return KeyService(session, gateway.state.keys).create(made["id"], KeyCreate(name="k"))

    def revoke(session: AsyncSession) -> Any:
        return KeyService(session, gateway.state.keys).revoke(key["id"])

    def read_key(session: AsyncSession) -> Any:
        return session.get(ApiKey, key["id"])

    assert gateway.run(after_its_delete(gateway.state, made["id"], make)) == "404 tenant_not_found"
    outcome = gateway.run(after_its_delete(gateway.state, revoked["id"], revoke, read_key))
    assert outcome == "404 key_not_found"


def test_keys_made_while_their_tenant_is_deleted_are_201_or_404_and_none_is_left(
    each_gateway: RunningServer,
) -> None:
    gateway, admin = each_gateway, admin_client(each_gateway)
    for _ in range(3):
        tenant = json_of(admin.post("/admin/tenants", json={"name": unique("racing")}))

        made, delete = gateway.run(_make_key_and_delete(gateway.state, tenant["id"]))

        assert (made, delete) in (("201", "200"), ("404", "200"))
        assert gateway.run(_keys_of(gateway.state, tenant["id"])) == 0


async def _make_key_and_delete(gw: GatewayState, ref: str) -> list[str]:
    async def make() -> str:
        async with gw.sessions() as session:
            try:
                await KeyService(session, gw.keys).create(ref, KeyCreate(name="k"))
            except NotFound:
                return "404"
            return "201"

    return list(await asyncio.gather(make(), delete_tenant(gw, ref)))


async def _keys_of(gw: GatewayState, tenant_id: str) -> int:
    async with gw.sessions() as session:
        query = select(func.count(ApiKey.id)).where(ApiKey.tenant_id == tenant_id)
        return int(await session.scalar(query) or 0)


def test_a_write_that_meets_a_deleted_tenant_without_its_lock_is_a_409(
    each_gateway: RunningServer,
) -> None:
    """The error mapping's safety net for a writer that does not lock the tenant: the database's
    own refusals (a foreign key to a deleted row, an UPDATE that matched none) are a 409 to
    retry, not a 500."""
    gateway, admin = each_gateway, admin_client(each_gateway)
    for write in (_orphan_key, _stale_patch):
        tenant = json_of(admin.post("/admin/tenants", json={"name": unique("unlocked")}))

        raised = gateway.run(_raised_after_its_delete(gateway.state, tenant["id"], write))

        error = to_gateway_error(raised)
        assert error is not None and (error.status, error.code) == (409, "concurrent_delete")


async def _orphan_key(session: AsyncSession, tenant: Tenant) -> None:
    new = mint_key()
    session.add(ApiKey(id=new.id, tenant_id=tenant.id, secret_hash=new.secret_hash))
    await session.commit()


async def _stale_patch(session: AsyncSession, tenant: Tenant) -> None:
    tenant.disabled = True
    await session.commit()


async def _raised_after_its_delete(
    gw: GatewayState, ref: str, write: Callable[[AsyncSession, Tenant], Awaitable[None]]
) -> Exception:
    """What `write` raises, given the tenant read in its session before another deleted it."""
    async with gw.sessions() as session:
        tenant = await get_tenant(session, ref)
        assert await delete_tenant(gw, ref) == "200"
        try:
            await write(session, tenant)
        except Exception as exc:
            return exc
        raise AssertionError(f"{write.__name__} wrote a row of the deleted tenant {ref}")
