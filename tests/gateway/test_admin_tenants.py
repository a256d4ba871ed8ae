"""Tenants and their API keys: create, read, rename, disable, delete; keys issued once, listed
without secrets, revoked at once, refused when expired."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.auth.api_keys import ApiKeyAuth, Principal
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.errors import Unauthorized
from loramux.gateway.keys.schemas import KeyCreate
from loramux.gateway.keys.service import KeyService
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of


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
    "no-break space": "acme\u00a0corp",
    "narrow no-break space": "acme\u202fcorp",
    "em space": "acme\u2003corp",
    "ideographic space": "acme\u3000corp",
    "combining grapheme joiner": "ac\u034fme",
    "variation selector-16": "acme\ufe0f",
    "hangul filler": "ac\u3164me",
    "hangul choseong filler": "\u115facme",
    "decomposed é (not NFC)": "cafe\u0301 corp",
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


@pytest.mark.parametrize("name", ["acme/corp", "acme?corp", "acme#corp", ".", "..", "..."])
def test_tenant_names_no_path_or_model_could_address_are_refused(
    admin: httpx.Client, name: str
) -> None:
    """A tenant is addressed by name in a path segment and in an `owner/name` model: a name
    holding `/`, `?` or `#`, or of dots alone, could be named by neither."""
    tenant = new_tenant(admin)
    for response in (
        admin.post("/admin/tenants", json={"name": name}),
        admin.patch(f"/admin/tenants/{tenant['id']}", json={"name": name}),
    ):
        assert response.status_code == 400, response.text
        error = json_of(response)["error"]
        assert (error["param"], error["code"]) == ("name", "invalid_request")
    assert new_key(admin, tenant["id"], name="ci/cd key?#1")["name"] == "ci/cd key?#1"


def test_a_tenant_is_addressed_by_any_name_it_may_take(admin: httpx.Client) -> None:
    for name in (unique("acme.corp 100% "), unique(".hidden"), unique("a&b=c;d")):
        tenant = json_of(admin.post("/admin/tenants", json={"name": name}))
        got = admin.get(f"/admin/tenants/{quote(name, safe='')}")
        assert got.status_code == 200 and json_of(got)["id"] == tenant["id"], got.text


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
