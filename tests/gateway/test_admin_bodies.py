"""Admin request bodies are decoded strictly into their typed shape: anything else is a 400 in
OpenAI's error shape whose `param` names the offending field, and it is audited."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.gateway.conftest import json_of


@pytest.fixture
def tenant(admin: httpx.Client) -> dict:
    return json_of(admin.post("/admin/tenants", json={"name": f"b-{uuid.uuid4().hex[:10]}"}))


def send(admin: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return admin.put(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"rpm": "60"}', "rpm"),
        (b'{"tpm": 18446744073709551616}', "tpm"),
        (b'{"max_concurrent": 1e400}', "max_concurrent"),
        (b'{"budget_period": "week"}', "budget_period"),
        (b'{"rmp": 1}', "rmp"),
    ],
)
def test_a_refused_field_is_named_in_param(
    admin: httpx.Client, tenant: dict, body: bytes, param: str | None
) -> None:
    response = send(admin, f"/admin/tenants/{tenant['id']}/quotas", body)
    assert response.status_code == 400, response.text
    error = json_of(response)["error"]
    assert (error["param"], error["code"], error["type"]) == (
        param,
        "invalid_request",
        "invalid_request_error",
    )


@pytest.mark.parametrize(
    "body",
    [
        b'{"rpm": 5, "budget_period": "\xff\xfe"}',
        b"\xff" + b'{"rpm": 5}',
        b'{"rpm": 5, "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"rpm": 5, "x": ' + b"[" * 50_000,
        b"[" * 50_000,
    ],
    ids=["invalid utf-8 in a string", "invalid utf-8 outside", "deep", "deep unclosed", "list"],
)
def test_hostile_bodies_are_400_and_change_nothing(
    admin: httpx.Client, tenant: dict, body: bytes
) -> None:
    path = f"/admin/tenants/{tenant['id']}/quotas"
    response = send(admin, path, body)
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == "invalid_request"
    assert json_of(admin.get(path))["rpm"] is None


def test_a_body_refused_before_the_handler_is_audited(admin: httpx.Client, tenant: dict) -> None:
    send(admin, f"/admin/tenants/{tenant['id']}/quotas", b"{not json")
    entries = json_of(admin.get("/admin/audit", params={"limit": 5}))["items"]
    mine = [e for e in entries if e["target"] == tenant["id"]]
    assert mine[0]["action"] == "quota.tenant.set"
    assert mine[0]["outcome"] == "invalid_request"
