"""The admin API past a handful of tenants: every list comes a page at a time with a total and
a name filter, and a tenant is addressed by its id or its name on every route that takes one."""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select, text

from loramux.gateway.admin.paging import Paging
from loramux.gateway.db import Tenant
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.tenants import new_tenant, upload_adapter
from tests.migrations.test_revisions import new_postgres_database


def walk(admin: httpx.Client, path: str, limit: int, **params: str) -> list[dict]:
    """Every item of a paginated list, page by page, checking each page's bookkeeping."""
    items: list[dict] = []
    offset = 0
    while True:
        page = json_of(admin.get(path, params={"limit": limit, "offset": offset, **params}))
        assert (page["limit"], page["offset"]) == (limit, offset)
        assert len(page["items"]) == min(limit, max(0, page["total"] - offset))
        items += page["items"]
        offset += limit
        if offset >= page["total"]:
            return items


def test_paging_over_250_tenants_returns_each_exactly_once(admin: httpx.Client) -> None:
    batch = f"page-{uuid.uuid4().hex[:8]}"
    names = [f"{batch}-{i:03d}" for i in range(250)]

    def create(name: str) -> str:
        response = admin.post("/admin/tenants", json={"name": name})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    with ThreadPoolExecutor(4) as pool:
        ids = set(pool.map(create, names))
    seen = walk(admin, "/admin/tenants", 37, name=batch.upper())
    assert sorted(t["name"] for t in seen) == names
    assert len({t["id"] for t in seen}) == 250 and {t["id"] for t in seen} == ids
    assert json_of(admin.get("/admin/tenants", params={"name": batch}))["total"] == 250
    assert len(json_of(admin.get("/admin/tenants", params={"name": batch}))["items"]) == 50


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 501},
        {"limit": 2**70},
        {"offset": -1},
        {"limit": "ten"},
        {"name": ""},
    ],
)
@pytest.mark.parametrize(
    "path", ["/admin/tenants", "/admin/adapters", "/admin/audit", "/admin/tenants/{t}/keys"]
)
def test_page_bounds_outside_the_limits_are_refused(
    admin: httpx.Client, path: str, params: dict
) -> None:
    tenant = new_tenant_json(admin)
    response = admin.get(path.format(t=tenant["id"]), params=params)
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == "invalid_request"


def new_tenant_json(admin: httpx.Client) -> dict:
    response = admin.post("/admin/tenants", json={"name": f"scale-{uuid.uuid4().hex[:10]}"})
    assert response.status_code == 201, response.text
    return response.json()


def test_a_tenant_is_addressed_by_its_name_on_every_route_that_takes_one(
    admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    tenant = new_tenant_json(admin)
    name, tid = tenant["name"], tenant["id"]
    assert json_of(admin.get(f"/admin/tenants/{name}")) == tenant
    key = json_of(admin.post(f"/admin/tenants/{name}/keys", json={"name": "ci"}))
    assert key["tenant_id"] == tid
    keys = json_of(admin.get(f"/admin/tenants/{name}/keys"))
    assert [k["id"] for k in keys["items"]] == [key["id"]] and keys["total"] == 1
    assert json_of(admin.put(f"/admin/tenants/{name}/quotas", json={"rpm": 7}))["tenant_id"] == tid
    assert json_of(admin.get(f"/admin/tenants/{name}/quotas"))["rpm"] == 7
    cache = json_of(admin.put(f"/admin/tenants/{name}/cache", json={"enabled": False}))
    assert cache["tenant_id"] == tid
    assert json_of(admin.get(f"/admin/tenants/{name}/cache"))["tenant_id"] == tid
    assert admin.delete("/admin/cache", params={"tenant": name}).status_code == 200

    adapter = upload_adapter(admin, name, "support-bot", demo_adapter_dirs[8])
    assert adapter["owner"] == tid
    listed = json_of(admin.get("/admin/adapters", params={"owner": name}))["items"]
    assert listed == [adapter]
    assert json_of(admin.get(f"/admin/adapters/{name}/support-bot"))["latest"] == adapter
    usage = admin.get("/admin/usage", params={"tenant": name, "group_by": "adapter"})
    assert json_of(usage)["tenant"] == tid
    stats = json_of(admin.get(f"/admin/tenants/{name}/cache/stats"))
    assert stats == json_of(admin.get(f"/admin/tenants/{tid}/cache/stats"))
    assert stats["tenant_id"] == tid
    for owner in (name, tid):
        purge = {"tenant": name, "adapter": f"{owner}/support-bot"}
        assert admin.delete("/admin/cache", params=purge).status_code == 200, owner

    renamed = json_of(admin.patch(f"/admin/tenants/{name}", json={"name": f"{name}-2"}))
    assert renamed["id"] == tid
    assert admin.get(f"/admin/tenants/{name}").status_code == 404
    deleted = admin.delete(f"/admin/adapters/{name}-2/support-bot")
    assert deleted.status_code == 200, deleted.text
    assert json_of(admin.delete(f"/admin/tenants/{name}-2"))["id"] == tid
    assert admin.get(f"/admin/tenants/{tid}").status_code == 404


@pytest.mark.parametrize("name", ["shared", "tnt_lookalike"])
def test_names_that_would_read_as_an_owner_or_an_id_are_refused(
    admin: httpx.Client, name: str
) -> None:
    response = admin.post("/admin/tenants", json={"name": name})
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["param"] == "name"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/admin/tenants//keys"),
        ("GET", "/admin/tenants//quotas"),
        ("GET", "/admin/adapters//support-bot"),
        ("DELETE", "/admin/adapters/shared//versions/1"),
        ("GET", "/admin//tenants"),
        ("GET", "/admin/tenants/%2Fkeys"),  # an encoded slash is routed as a slash
        ("POST", "/admin/tenants/%2f%2Fkeys"),
        ("GET", "/admin/tenants/probe%2F%2Fkeys"),
    ],
)
def test_an_empty_path_segment_is_a_404_that_says_so(
    admin: httpx.Client, method: str, path: str
) -> None:
    response = admin.request(method, path)
    assert response.status_code == 404, response.text
    error = json_of(response)["error"]
    assert error["code"] == "empty_path_segment" and "empty segment" in error["message"]


def test_an_encoded_empty_segment_deletes_nothing(admin: httpx.Client) -> None:
    """`DELETE /admin/tenants/%2F<tenant>` was routed as `/admin/tenants//<tenant>`, past the
    check for a literal `//`, and deleted that tenant (found by attacking the admin API)."""
    bystander = new_tenant(admin, "bystander")
    refused = admin.delete(f"/admin/tenants/%2F{bystander.tenant_id}")
    assert refused.status_code == 404 and json_of(refused)["error"]["code"] == "empty_path_segment"
    assert admin.get(f"/admin/tenants/{bystander.tenant_id}").status_code == 200


def test_key_lists_filter_by_name(admin: httpx.Client) -> None:
    tenant = new_tenant(admin, "keys")
    for name in ("deploy-bot", "Deploy-2", "ci"):
        assert admin.post(f"/admin/tenants/{tenant.tenant_id}/keys", json={"name": name}).is_success
    page = json_of(admin.get(f"/admin/tenants/{tenant.tenant_id}/keys", params={"name": "deploy"}))
    assert sorted(k["name"] for k in page["items"]) == ["Deploy-2", "deploy-bot"]
    assert page["total"] == 2
    wildcard = admin.get(f"/admin/tenants/{tenant.tenant_id}/keys", params={"name": "%"})
    assert json_of(wildcard)["total"] == 0


def test_a_name_filter_finds_a_non_ascii_name_on_either_database(
    each_gateway: RunningServer,
) -> None:
    """`name=` ignores case for ASCII letters on every database (SQL lower() folds only those on
    SQLite and in PostgreSQL's C locale); a name with other letters is found by the text as it
    is written, whatever the database folds."""
    mark = uuid.uuid4().hex[:8]
    name = f"Ölwerk-ÉTÉ-{mark}"
    with admin_client(each_gateway) as admin:
        assert admin.post("/admin/tenants", json={"name": name}).status_code == 201
        for needle in (
            name,
            f"Ölwerk-été-{mark}".upper(),
            f"ÉTÉ-{mark}",
            f"Ölwerk-ÉTÉ-{mark.upper()}",
        ):
            page = json_of(admin.get("/admin/tenants", params={"name": needle}))
            assert [t["name"] for t in page["items"]] == [name], needle


@pytest.mark.parametrize("name", ["ΟΔΟΣ", "İzmir"])
def test_a_name_filter_finds_a_name_by_itself_where_the_database_folds_unicode(
    postgres_url: str, name: str
) -> None:
    """In a UTF-8 locale PostgreSQL's lower() folds a letter at a time and unlike Python's
    (a final `Σ` to `σ`, not `ς`; `İ` to `i`, not `i̇`): a name is found by its own text all
    the same, both sides folded by the database."""
    url = new_postgres_database(postgres_url, locale="C.utf8")
    upgrade(url)

    async def found() -> list[str]:
        engine = create_engine(url)
        try:
            async with session_factory(engine)() as session:
                assert await session.scalar(text("SELECT lower(:n)"), {"n": name}) != name
                session.add(Tenant(name=name))
                await session.commit()
                where = Paging(limit=50, offset=0, name=name).name_filter(Tenant.name)
                return list(await session.scalars(select(Tenant.name).where(where)))
        finally:
            await engine.dispose()

    assert asyncio.run(found()) == [name]


NUL_REFERENCES = [
    ("GET", "/admin/tenants/a%00b", 404),
    ("GET", "/admin/tenants/a%00b/keys", 404),
    ("POST", "/admin/tenants/a%00b/keys", 404),
    ("GET", "/admin/keys/a%00b/quotas", 404),
    ("GET", "/admin/adapters/shared/a%00b", 404),
    ("GET", "/admin/tenants?name=%00", 400),
    ("GET", "/admin/adapters?name=%00", 400),
    ("GET", "/admin/audit?name=%00", 400),
    ("GET", "/admin/usage?tenant=a%00b", 400),
]


@pytest.mark.parametrize(("method", "path", "status"), NUL_REFERENCES)
def test_a_reference_or_filter_holding_nul_is_refused_alike_on_either_database(
    each_gateway: RunningServer, method: str, path: str, status: int
) -> None:
    """No name or id holds NUL: a path naming one names nothing (404), a filter holding one
    is a bad filter (400), the same on SQLite and PostgreSQL. Each reached the database: on
    PostgreSQL, which cannot compare text holding NUL (22021), a 500; on SQLite, whose LIKE
    ends a pattern at NUL, `?name=%00` matched every row."""
    with admin_client(each_gateway) as admin:
        response = admin.request(method, path)
    assert response.status_code == status, response.text
    assert "NUL" in json_of(response)["error"]["message"]


def test_an_owner_holding_nul_is_not_found_on_either_database(
    each_gateway: RunningServer, demo_adapter_dirs: list[Path]
) -> None:
    """A tenant reference in a body (an upload's `owner`) holding NUL names no tenant: 404 on
    both databases, where PostgreSQL failed the lookup (22021) with a 500."""
    with admin_client(each_gateway) as admin:
        response = admin.post(
            "/admin/adapters",
            data={"name": "nul-owner", "owner": "a\u0000b"},
            files={
                field: (file, (demo_adapter_dirs[3] / file).read_bytes())
                for field, file in (
                    ("adapter_config", "adapter_config.json"),
                    ("adapter_model", "adapter_model.safetensors"),
                )
            },
        )
    assert response.status_code == 404, response.text
    assert json_of(response)["error"]["code"] == "tenant_not_found"
