"""`/admin/usage` sums usage events per UTC day, adapter or key, within [from, to)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
import pytest

from loramux.gateway.server import RunningServer
from loramux.gateway.usage import UsageRecord
from tests.gateway.conftest import json_of

DAY1, DAY2 = datetime(2031, 3, 1, 23, 30, tzinfo=UTC), datetime(2031, 3, 2, 0, 15, tzinfo=UTC)


def event(tenant: str, when: datetime, **fields: object) -> UsageRecord:
    values: dict = {
        "request_id": f"req_{uuid.uuid4().hex[:12]}",
        "tenant_id": tenant,
        "key_id": "key-a",
        "model": "support",
        "adapter_digest": None,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "cached_tokens": 0,
        "cache": "miss",
        "status": 200,
        "latency_ms": 100.0,
        "ttft_ms": None,
        "created_at": when,
    }
    return UsageRecord(**(values | fields))


@pytest.fixture(scope="module")
def tenant(gateway: RunningServer) -> str:
    """A tenant id with five events over two UTC days, two models and two keys."""
    tenant_id = f"tnt_usage{uuid.uuid4().hex[:8]}"
    events = [
        event(tenant_id, DAY1),
        event(tenant_id, DAY1, cache="exact", cached_tokens=10, latency_ms=2.0),
        event(tenant_id, DAY1, model="demo-model", key_id="key-b", status=429, latency_ms=1.0),
        event(tenant_id, DAY2, cache="semantic", latency_ms=3.0),
        event(tenant_id, DAY2, model="demo-model", prompt_tokens=7, completion_tokens=0),
        event("tnt_someone_else", DAY1, prompt_tokens=1000),
    ]

    async def record() -> None:
        for e in events:
            gateway.state.usage.record(e)
        await gateway.state.usage.flush()

    gateway.run(record())
    return tenant_id


def report(admin: httpx.Client, **params: str) -> dict:
    response = admin.get("/admin/usage", params=params)
    assert response.status_code == 200, response.text
    return json_of(response)


def test_by_day(admin: httpx.Client, tenant: str) -> None:
    rows = report(admin, tenant=tenant, group_by="day")["rows"]
    assert [r["group"] for r in rows] == ["2031-03-01", "2031-03-02"]
    first, second = rows
    assert (first["requests"], first["prompt_tokens"], first["completion_tokens"]) == (3, 30, 15)
    assert (first["cached_tokens"], first["cache_hits"], first["errors"]) == (10, 1, 1)
    assert first["mean_latency_ms"] == pytest.approx((100 + 2 + 1) / 3)
    assert first["tenant_id"] is None
    assert (second["requests"], second["prompt_tokens"], second["cache_hits"]) == (2, 17, 1)


def test_by_adapter_and_by_key(admin: httpx.Client, tenant: str) -> None:
    by_model = {r["group"]: r for r in report(admin, tenant=tenant, group_by="adapter")["rows"]}
    assert {m: r["requests"] for m, r in by_model.items()} == {"demo-model": 2, "support": 3}
    assert {r["tenant_id"] for r in by_model.values()} == {tenant}
    by_key = {
        r["group"]: r["requests"] for r in report(admin, tenant=tenant, group_by="key")["rows"]
    }
    assert by_key == {"key-a": 4, "key-b": 1}


def test_bounds(admin: httpx.Client, tenant: str) -> None:
    one_day = report(admin, tenant=tenant, **{"from": "2031-03-01", "to": "2031-03-01"})
    assert [r["group"] for r in one_day["rows"]] == ["2031-03-01"]
    assert one_day["from"] == "2031-03-01T00:00:00Z" and one_day["to"] == "2031-03-02T00:00:00Z"
    later = report(admin, tenant=tenant, **{"from": "2031-03-02T00:00:00+00:00"})
    assert [r["group"] for r in later["rows"]] == ["2031-03-02"]
    # 01:00 at UTC+2 is 23:00 UTC the day before: only DAY1's 23:30 events are after it.
    shifted = report(
        admin, tenant=tenant, **{"from": "2031-03-02T01:00:00+02:00", "to": "2031-03-02T00:00:00"}
    )
    assert [(r["group"], r["requests"]) for r in shifted["rows"]] == [("2031-03-01", 3)]


def test_all_tenants(admin: httpx.Client, tenant: str) -> None:
    rows = report(admin, **{"from": "2031-03-01", "to": "2031-03-01"})["rows"]
    assert rows[0]["prompt_tokens"] >= 30 + 1000


@pytest.mark.parametrize(
    "params",
    [
        {"group_by": "hour"},
        {"from": "yesterday"},
        {"to": "2031-13-01"},
        {"from": "2031-03-02", "to": "2031-03-01"},
    ],
)
def test_bad_parameters_are_400(admin: httpx.Client, params: dict) -> None:
    response = admin.get("/admin/usage", params=params)
    assert response.status_code == 400, response.text


@pytest.mark.parametrize(
    "params",
    [
        {"to": "9999-12-31"},
        {"from": "0001-01-01T00:00:00+01:00"},
        {"to": "9999-12-31T23:00:00-05:00"},
    ],
)
def test_bounds_past_the_calendar_are_400(admin: httpx.Client, params: dict) -> None:
    """A bound UTC cannot express (an offset carries it before year 1 or after 9999; a `to` date
    ends at the midnight after it, which 9999-12-31 lacks) is a 400 naming it. It was a 500:
    an OverflowError the parser did not catch."""
    response = admin.get("/admin/usage", params=params)
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["param"] in params
    assert "out of range" in json_of(response)["error"]["message"]


@pytest.mark.parametrize("start", ["9999-12-31T12:00:00", "9999-12-31T23:30:00"])
def test_a_range_in_the_calendars_last_day_is_read(admin: httpx.Client, start: str) -> None:
    """A `from` in 9999-12-31, the last day a time can hold, reads its part of that day (no
    events). Cutting the range into whole days and hours looked for the next midnight or hour,
    past the last one: a 500."""
    assert report(admin, **{"from": start})["rows"] == []
