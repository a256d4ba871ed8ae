"""Quotas per tenant and per key: a field left out keeps its limit, `null` removes it, and a bad
value is a 400 that changes nothing."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from sqlalchemy import func, select

from loramux.gateway.db import Quota
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of

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
