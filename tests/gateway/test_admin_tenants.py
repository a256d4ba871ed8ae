"""Tenants and their API keys: create, read, rename, disable, delete; keys issued once, listed
without secrets, revoked at once, refused when expired."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.auth.api_keys import ApiKeyAuth, Principal, mint_key
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import NotFound, Unauthorized, to_gateway_error
from loramux.gateway.keys.schemas import KeyCreate
from loramux.gateway.keys.service import KeyService
from loramux.gateway.server import RunningServer
from loramux.gateway.state import GatewayState
from loramux.gateway.tenants.lookup import get_tenant
from loramux.gateway.tenants.schemas import TenantUpdate
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.tenants import after_its_delete, delete_tenant, tenant_service


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def new_tenant(admin: httpx.Client) -> dict:
    response = admin.post("/admin/tenants", json={"name": unique("tenant")})
    assert response.status_code == 201, response.text
    return json_of(response)


def new_key(admin: httpx.Client, tenant_id: str, **body: object) -> dict:
    response = admin.post(f"/admin/tenants/{tenant_id}/keys", json=body or None)
    assert response.status_code == 201, response.text
    return json_of(response)


def authenticate(gateway: RunningServer, key: str) -> Principal:
    return gateway.run(gateway.state.keys.authenticate(f"Bearer {key}"))


def refused(gateway: RunningServer, key: str) -> str:
    with pytest.raises(Unauthorized) as raised:
        authenticate(gateway, key)
    return raised.value.message


def test_tenant_lifecycle(admin: httpx.Client) -> None:
    tenant = new_tenant(admin)
    assert tenant["id"].startswith("tnt_") and tenant["disabled"] is False
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}")) == tenant
    listed = json_of(admin.get("/admin/tenants", params={"name": tenant["name"]}))["items"]
    assert [t["id"] for t in listed] == [tenant["id"]]

    renamed = unique("renamed")
    patched = json_of(admin.patch(f"/admin/tenants/{tenant['id']}", json={"name": renamed}))
    assert (patched["name"], patched["disabled"]) == (renamed, False)
    patched = json_of(admin.patch(f"/admin/tenants/{tenant['id']}", json={"disabled": True}))
    assert (patched["name"], patched["disabled"]) == (renamed, True)

    deleted = admin.delete(f"/admin/tenants/{tenant['id']}")
    assert deleted.status_code == 200 and json_of(deleted)["deleted"] is True
    assert admin.get(f"/admin/tenants/{tenant['id']}").status_code == 404
    assert admin.delete(f"/admin/tenants/{tenant['id']}").status_code == 404


def test_tenant_names_are_unique(admin: httpx.Client) -> None:
    first, second = new_tenant(admin), new_tenant(admin)
    clash = admin.post("/admin/tenants", json={"name": first["name"]})
    assert clash.status_code == 409 and json_of(clash)["error"]["code"] == "name_taken"
    rename = admin.patch(f"/admin/tenants/{second['id']}", json={"name": first["name"]})
    assert rename.status_code == 409
    assert json_of(admin.get(f"/admin/tenants/{second['id']}"))["name"] == second["name"]


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[]",
        b'{"name": ""}',
        b'{"name": "  padded  "}',
        b'{"name": 7}',
        b'{"name": "ok", "colour": "blue"}',
        b"{}",
    ],
)
def test_malformed_tenant_bodies_are_400(admin: httpx.Client, body: bytes) -> None:
    response = admin.post(
        "/admin/tenants", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == "invalid_request"


DISGUISED_NAMES = {
    "NUL": "acme\x00corp",
    "bell": "acme\x07",
    "escape sequence": "\x1b[31macme",
    "tab": "acme\tcorp",
    "newline": "acme\ncorp",
    "right-to-left override": "acme\u202egnp.exe",
    "right-to-left isolate": "acme\u2067corp",
    "zero-width space": "ac\u200bme",
    "byte order mark": "\ufeffacme",
    "line separator": "acme\u2028corp",
    "leading space": " acme",
    "trailing no-break space": "acme\u00a0",
    "201 characters": "a" * 201,
}


@pytest.mark.parametrize("case", list(DISGUISED_NAMES))
def test_names_that_hide_or_disguise_text_are_refused(admin: httpx.Client, case: str) -> None:
    name = DISGUISED_NAMES[case]
    tenant = new_tenant(admin)
    attempts = [
        admin.post("/admin/tenants", json={"name": name}),
        admin.patch(f"/admin/tenants/{tenant['id']}", json={"name": name}),
        admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": name}),
    ]
    for response in attempts:
        assert response.status_code == 400, response.text
        error = json_of(response)["error"]
        assert (error["param"], error["code"]) == ("name", "invalid_request")
        assert "name" in error["message"]
    if "\x00" not in name:  # a filter holding NUL is refused itself (test_admin_scaling)
        same_name = json_of(admin.get("/admin/tenants", params={"name": name[:200]}))["items"]
        assert all(t["name"] != name for t in same_name)
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}"))["name"] == tenant["name"]
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}/keys"))["items"] == []


def test_names_in_any_script_are_accepted(admin: httpx.Client) -> None:
    name = unique("Café 東京 Ωmega 🚀 ﷺ")
    tenant = json_of(admin.post("/admin/tenants", json={"name": name}))
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}"))["name"] == name
    assert new_key(admin, tenant["id"], name="déploiement 2")["name"] == "déploiement 2"


def test_patch_validates_types(admin: httpx.Client) -> None:
    tenant = new_tenant(admin)
    response = admin.patch(f"/admin/tenants/{tenant['id']}", json={"disabled": "yes"})
    assert response.status_code == 400
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}"))["disabled"] is False


def test_a_new_key_is_shown_once_and_authenticates(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = new_tenant(admin)
    key = new_key(admin, tenant["id"], name="ci", allowed_models=["demo-model"])
    assert key["key"].startswith(key["prefix"] + ".") and key["prefix"] == f"lmx-{key['id']}"
    assert (key["name"], key["allowed_models"], key["revoked_at"]) == ("ci", ["demo-model"], None)

    principal = authenticate(gateway, key["key"])
    assert (principal.tenant_id, principal.key_id) == (tenant["id"], key["id"])
    assert principal.allowed_models == ("demo-model",)

    listed = json_of(admin.get(f"/admin/tenants/{tenant['id']}/keys"))["items"]
    assert [k["id"] for k in listed] == [key["id"]]
    assert "key" not in listed[0] and key["key"] not in str(listed)
    assert listed[0]["prefix"] == key["prefix"]


def test_a_revoked_key_fails_at_once(gateway: RunningServer, admin: httpx.Client) -> None:
    tenant = new_tenant(admin)
    key = new_key(admin, tenant["id"])
    authenticate(gateway, key["key"])  # now cached in this process
    revoked = json_of(admin.delete(f"/admin/keys/{key['id']}"))
    assert revoked["revoked_at"] is not None
    assert "revoked" in refused(gateway, key["key"])
    again = json_of(admin.delete(f"/admin/keys/{key['id']}"))
    assert again["revoked_at"] == revoked["revoked_at"]
    listed = json_of(admin.get(f"/admin/tenants/{tenant['id']}/keys"))["items"]
    assert listed[0]["revoked_at"] == revoked["revoked_at"]
    assert admin.delete("/admin/keys/nosuchkey").status_code == 404


def test_expiry(gateway: RunningServer, admin: httpx.Client) -> None:
    tenant = new_tenant(admin)
    soon = datetime.now(UTC) + timedelta(hours=1)
    at = new_key(admin, tenant["id"], expires_at=soon.isoformat())
    assert datetime.fromisoformat(at["expires_at"]) == soon
    within = new_key(admin, tenant["id"], expires_in=3600)
    assert datetime.fromisoformat(within["expires_at"]) > datetime.now(UTC)
    authenticate(gateway, within["key"])

    async def backdate() -> None:
        async with gateway.state.sessions() as session:
            past = datetime.now(UTC) - timedelta(seconds=1)
            await session.execute(
                update(ApiKey).where(ApiKey.id == within["id"]).values(expires_at=past)
            )
            await session.commit()
        gateway.state.keys.forget(within["id"])

    gateway.run(backdate())
    assert "expired" in refused(gateway, within["key"])


@pytest.mark.parametrize(
    "body",
    [
        {"expires_in": 0},
        {"expires_in": 60, "expires_at": "2099-01-01T00:00:00Z"},
        {"expires_at": "2001-01-01T00:00:00Z"},
        {"expires_at": "tomorrow"},
        {"allowed_models": "demo-model"},
        {"allowed_models": [""]},
        {"scopes": ["all"]},
    ],
)
def test_bad_key_requests_are_400(admin: httpx.Client, body: dict) -> None:
    tenant = new_tenant(admin)
    response = admin.post(f"/admin/tenants/{tenant['id']}/keys", json=body)
    assert response.status_code == 400, response.text
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}/keys"))["items"] == []


def test_keys_of_a_missing_tenant_are_404(admin: httpx.Client) -> None:
    assert admin.post("/admin/tenants/tnt_nope/keys").status_code == 404
    assert admin.get("/admin/tenants/tnt_nope/keys").status_code == 404


def test_disabling_or_deleting_a_tenant_stops_its_keys_at_once(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    tenant = new_tenant(admin)
    key = new_key(admin, tenant["id"])
    authenticate(gateway, key["key"])
    admin.patch(f"/admin/tenants/{tenant['id']}", json={"disabled": True})
    assert "disabled" in refused(gateway, key["key"])
    admin.patch(f"/admin/tenants/{tenant['id']}", json={"disabled": False})
    authenticate(gateway, key["key"])

    deleted = json_of(admin.delete(f"/admin/tenants/{tenant['id']}"))
    assert deleted["detail"]["keys"] == 1
    assert refused(gateway, key["key"]) == "invalid API key"
    assert admin.get(f"/admin/keys/{key['id']}/quotas").status_code == 404


class _ReadsHeld:
    """Sessions whose reads of a tenant row wait, once `hold` is set, until `release`: a key
    lookup caught between reading the database and caching what it read."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]):
        self.sessions, self.hold = sessions, False
        self.reached, self.release = asyncio.Event(), asyncio.Event()

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[AsyncSession]:
        async with self.sessions() as session:
            read = session.get

            async def get(kind: Any, ident: Any, **options: Any) -> Any:
                row = await read(kind, ident, **options)
                if kind is Tenant and self.hold:
                    self.reached.set()
                    await self.release.wait()
                return row

            session.get = get  # type: ignore[method-assign]
            yield session


@pytest.mark.parametrize("empty_url", ["sqlite"], indirect=True)
async def test_a_lookup_under_way_does_not_bring_a_revoked_key_back(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A request's key lookup read the key's row before its revocation committed, and cached
    it after the revocation forgot it: the revoked key worked on in the process that revoked
    it, for the cache's whole ttl (found by attacking the admin API). The request under way
    still passes (it came first); the next one is refused."""
    async with sessions() as session:
        session.add(Tenant(id="tnt_racer0000001", name="racer", disabled=False, settings={}))
        await session.commit()
    held = _ReadsHeld(sessions)
    auth = ApiKeyAuth(held, ttl=60.0)  # type: ignore[arg-type]
    async with sessions() as session:
        key = await KeyService(session, auth).create("tnt_racer0000001", KeyCreate())
    held.hold = True
    under_way = asyncio.ensure_future(auth.authenticate(f"Bearer {key.key}"))
    await held.reached.wait()
    async with sessions() as session:
        await KeyService(session, auth).revoke(key.id)
    held.hold = False
    held.release.set()
    await under_way
    with pytest.raises(Unauthorized, match="revoked"):
        await auth.authenticate(f"Bearer {key.key}")


@pytest.mark.parametrize("expires_at", ["9999-12-31T23:59:59-12:00", "0001-01-01T00:00:00+12:00"])
def test_an_expiry_utc_cannot_express_is_400(admin: httpx.Client, expires_at: str) -> None:
    """An `expires_at` whose offset carries it past 9999-12-31 or before 0001-01-01 in UTC is
    a 400 naming it, and no key is made. Converting it to UTC overflowed: a 500."""
    tenant = new_tenant(admin)
    response = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"expires_at": expires_at})
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["param"] == "expires_at"
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}/keys"))["items"] == []


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
