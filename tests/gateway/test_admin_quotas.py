"""Quotas per tenant and per key: a field left out keeps its limit, `null` removes it, and a bad
value is a 400 that changes nothing."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from sqlalchemy import func, select

from loramux.gateway.db import Quota
from loramux.gateway.errors import NotFound
from loramux.gateway.quotas.limits import QuotaLimits
from loramux.gateway.quotas.schemas import QuotaUpdate
from loramux.gateway.server import RunningServer
from loramux.gateway.state import GatewayState
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.tenants import delete_tenant

NO_LIMITS = {
    "rpm": None,
    "tpm": None,
    "max_concurrent": None,
    "token_budget": None,
    "budget_period": None,
}


@pytest.fixture
def tenant(admin: httpx.Client) -> dict:
    return json_of(admin.post("/admin/tenants", json={"name": f"q-{uuid.uuid4().hex[:10]}"}))


@pytest.fixture
def key(admin: httpx.Client, tenant: dict) -> dict:
    return json_of(admin.post(f"/admin/tenants/{tenant['id']}/keys"))


def limits(quota: dict) -> dict:
    return {name: quota[name] for name in NO_LIMITS}


def put(admin: httpx.Client, path: str, body: dict) -> dict:
    response = admin.put(path, json=body)
    assert response.status_code == 200, response.text
    return json_of(response)


@pytest.mark.parametrize("scope", ["tenant", "key"])
def test_absent_keeps_null_removes(
    admin: httpx.Client, tenant: dict, key: dict, scope: str
) -> None:
    path = (
        f"/admin/tenants/{tenant['id']}/quotas"
        if scope == "tenant"
        else f"/admin/keys/{key['id']}/quotas"
    )
    fresh = json_of(admin.get(path))
    assert limits(fresh) == NO_LIMITS
    assert (fresh["tenant_id"], fresh["key_id"]) == (
        tenant["id"],
        None if scope == "tenant" else key["id"],
    )

    set_all = {"rpm": 60, "tpm": 10_000, "max_concurrent": 4}
    assert limits(put(admin, path, set_all)) == NO_LIMITS | set_all
    budget = {"token_budget": 5_000_000_000, "budget_period": "month"}
    assert limits(put(admin, path, budget)) == NO_LIMITS | set_all | budget
    after = put(admin, path, {"tpm": None, "rpm": 120})
    expected = NO_LIMITS | set_all | budget | {"tpm": None, "rpm": 120}
    assert limits(after) == expected
    assert limits(put(admin, path, {})) == expected
    assert limits(json_of(admin.get(path))) == expected


def test_tenant_and_key_quotas_are_separate(admin: httpx.Client, tenant: dict, key: dict) -> None:
    put(admin, f"/admin/tenants/{tenant['id']}/quotas", {"rpm": 10})
    put(admin, f"/admin/keys/{key['id']}/quotas", {"rpm": 3})
    assert json_of(admin.get(f"/admin/tenants/{tenant['id']}/quotas"))["rpm"] == 10
    assert json_of(admin.get(f"/admin/keys/{key['id']}/quotas"))["rpm"] == 3


@pytest.mark.parametrize(
    "body",
    [
        {"rpm": 0},
        {"rpm": -5},
        {"rpm": 1.5},
        {"rpm": "60"},
        {"rpm": True},
        {"tpm": 2**31},
        {"max_concurrent": []},
        {"budget_period": "week"},
        {"token_budget": 1000},
        {"token_budget": 1000, "budget_period": None},
        {"rmp": 60},
    ],
)
def test_bad_values_are_400_and_change_nothing(
    admin: httpx.Client, tenant: dict, body: dict
) -> None:
    path = f"/admin/tenants/{tenant['id']}/quotas"
    put(admin, path, {"rpm": 7})
    response = admin.put(path, json=body)
    assert response.status_code == 400, response.text
    assert limits(json_of(admin.get(path))) == NO_LIMITS | {"rpm": 7}


def test_a_budget_period_can_go_only_with_its_budget(admin: httpx.Client, tenant: dict) -> None:
    path = f"/admin/tenants/{tenant['id']}/quotas"
    put(admin, path, {"token_budget": 100, "budget_period": "day"})
    assert admin.put(path, json={"budget_period": None}).status_code == 400
    cleared = put(admin, path, {"token_budget": None, "budget_period": None})
    assert limits(cleared) == NO_LIMITS


def test_quotas_of_missing_owners_are_404(admin: httpx.Client) -> None:
    assert admin.put("/admin/tenants/tnt_nope/quotas", json={"rpm": 1}).status_code == 404
    assert admin.get("/admin/keys/nope/quotas").status_code == 404
    assert admin.put("/admin/keys/nope/quotas", json={"rpm": 1}).status_code == 404


@pytest.mark.parametrize("scope", ["tenant", "key"])
async def test_concurrent_first_updates_all_apply_to_one_row(
    gateway: RunningServer, admin_token: str, admin: httpx.Client, scope: str
) -> None:
    """The first quota writes of a scope race to insert its row: every one succeeds, and the
    scope ends up with one row holding each write's field."""
    tenants = [json_of(admin.post("/admin/tenants", json={"name": f"race-{uuid.uuid4().hex}"}))]
    tenants += [json_of(admin.post("/admin/tenants", json={"name": f"race-{uuid.uuid4().hex}"}))]
    paths = []
    for tenant in tenants:
        if scope == "tenant":
            paths.append(f"/admin/tenants/{tenant['id']}/quotas")
        else:
            key = json_of(admin.post(f"/admin/tenants/{tenant['id']}/keys"))
            paths.append(f"/admin/keys/{key['id']}/quotas")
    writes = [{"rpm": 10}, {"tpm": 20}, {"max_concurrent": 30}, {"rpm": 10, "tpm": 20}]
    headers = {"authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=60) as client:
        responses = await asyncio.gather(
            *(client.put(path, json=body) for path in paths for body in writes)
        )
    assert [r.status_code for r in responses] == [200] * len(responses), [
        r.text for r in responses if r.status_code != 200
    ]
    for tenant, path in zip(tenants, paths, strict=True):
        assert limits(json_of(admin.get(path))) == NO_LIMITS | {
            "rpm": 10,
            "tpm": 20,
            "max_concurrent": 30,
        }

        async def rows(tenant_id: str = tenant["id"]) -> int:
            async with gateway.state.sessions() as session:
                query = select(func.count(Quota.id)).where(Quota.tenant_id == tenant_id)
                return int(await session.scalar(query) or 0)

        assert gateway.run(rows()) == 1


@pytest.mark.parametrize("scope", ["tenant", "key"])
@pytest.mark.parametrize("first", [True, False], ids=["first write", "update"])
def test_quotas_set_while_their_tenant_is_deleted_are_200_or_404(
    each_gateway: RunningServer, scope: str, first: bool
) -> None:
    """Read before the delete committed, written after: the update of the scope's row matched
    none (StaleDataError), or a first write's row lost its foreign key; 500s."""
    gateway, admin = each_gateway, admin_client(each_gateway)
    for _ in range(3):
        tenant = json_of(admin.post("/admin/tenants", json={"name": f"q-{uuid.uuid4().hex}"}))
        scoped: tuple[str, str | None] = (tenant["id"], None)
        if scope == "key":
            scoped = (
                tenant["id"],
                json_of(admin.post(f"/admin/tenants/{tenant['id']}/keys"))["id"],
            )
        if not first:
            gateway.run(_set_quota(gateway.state, *scoped, rpm=5))

        quota, delete = gateway.run(_set_quota_and_delete(gateway.state, *scoped))

        assert (quota, delete) in (("200", "200"), ("404", "200"))
        assert gateway.run(_quota_rows(gateway.state, tenant["id"])) == 0


async def _set_quota(gw: GatewayState, tenant_id: str, key_id: str | None, rpm: int = 10) -> str:
    """Set an rpm through the admin API's own service, in a session of its own; what the
    handler would have answered."""
    async with gw.sessions() as session:
        limits = QuotaLimits(session, gw.redis)
        try:
            if key_id is None:
                await limits.set_for_tenant(tenant_id, QuotaUpdate(rpm=rpm))
            else:
                await limits.set_for_key(key_id, QuotaUpdate(rpm=rpm))
        except NotFound:
            return "404"
        return "200"


async def _set_quota_and_delete(gw: GatewayState, tenant_id: str, key_id: str | None) -> list[str]:
    return list(
        await asyncio.gather(_set_quota(gw, tenant_id, key_id), delete_tenant(gw, tenant_id))
    )


async def _quota_rows(gw: GatewayState, tenant_id: str) -> int:
    async with gw.sessions() as session:
        query = select(func.count(Quota.id)).where(Quota.tenant_id == tenant_id)
        return int(await session.scalar(query) or 0)
