"""The dashboard while the quota Redis (the live panel's figures, the record of sign-outs) is down
or silent: the page and its data still answer with the usage and budgets read from SQL and say
the live figures are unavailable; a sign-out it cannot record says so, and the cookie goes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.dashboard.session import COOKIE
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.servers import TcpRelay, gateway_server
from tests.gateway.tenants import TenantKey, new_tenant
from tests.redis import RedisServer, running_redis

QUOTA = {"rpm": 100, "max_concurrent": 4, "token_budget": 1_000_000, "budget_period": "day"}


@pytest.fixture(scope="module")
def quota_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own, to pause."""
    with running_redis(tmp_path_factory.mktemp("dashboard-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def relay(quota_redis: RedisServer) -> Iterator[TcpRelay]:
    """Between the gateway and its Redis, to cut it off."""
    relay = TcpRelay(quota_redis.port)
    try:
        yield relay
    finally:
        relay.close()


@pytest.fixture(scope="module")
def cut_off(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, relay: TcpRelay
) -> Iterator[RunningServer]:
    """A gateway whose quota Redis is reached through `relay`."""
    with gateway_server(
        demo_model_dir, tmp_path_factory.mktemp("dashboard-gw"), relay.redis_url
    ) as s:
        yield s


def limited_tenant(gateway: RunningServer, prefix: str) -> TenantKey:
    with admin_client(gateway) as admin:
        t = new_tenant(admin, prefix)
        assert admin.put(f"/admin/tenants/{t.tenant_id}/quotas", json=QUOTA).status_code == 200
    return t


@contextlib.contextmanager
def signed_in(gateway: RunningServer, credential: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        r = client.post("/dashboard/login", data={"credential": credential})
        assert r.status_code == 303 and client.get("/dashboard/data").status_code == 200
        yield client


def assert_live_unavailable(r: httpx.Response) -> None:
    """Budgets come from SQL and stay; the per-minute and concurrency figures are unknown."""
    assert r.status_code == 200, r.text
    data = json_of(r)
    assert data["live_available"] is False and data["in_flight"] is None
    used = {q["limit"]: q["used"] for q in data["quotas"]}
    assert used["tokens per day"] == 0
    assert used["requests per minute"] is None and used["concurrent requests"] is None


def test_the_dashboard_answers_while_the_quota_redis_is_unreachable(
    cut_off: RunningServer, relay: TcpRelay
) -> None:
    t = limited_tenant(cut_off, "dash-redis-down")
    admin_token = cut_off.state.admin.mint("test-admin", ttl_seconds=600)
    with signed_in(cut_off, t.key) as client, signed_in(cut_off, admin_token) as admin:
        relay.block()
        try:
            data = client.get("/dashboard/data")
            page = client.get("/dashboard")
            everyone = admin.get("/dashboard")
        finally:
            relay.unblock()
    assert_live_unavailable(data)
    assert page.status_code == 200 and 'data-testid="live-unavailable"' in page.text
    assert everyone.status_code == 200 and 'data-testid="live-unavailable"' in everyone.text


def test_the_dashboard_answers_while_the_quota_redis_is_silent(
    cut_off: RunningServer, quota_redis: RedisServer
) -> None:
    """A Redis that takes connections and answers nothing (paused): the live reads give up
    after the quota service's Redis timeout (LORAMUX_QUOTA_REDIS_TIMEOUT_MS)."""
    t = limited_tenant(cut_off, "dash-redis-silent")
    with signed_in(cut_off, t.key) as client:
        quota_redis.pause()
        try:
            data = client.get("/dashboard/data")
        finally:
            quota_redis.resume()
        assert_live_unavailable(data)
        assert json_of(client.get("/dashboard/data"))["live_available"] is True


def test_a_sign_out_the_quota_redis_cannot_record_says_so(
    cut_off: RunningServer, relay: TcpRelay
) -> None:
    with admin_client(cut_off) as admin:
        t = new_tenant(admin, "dash-sign-out")
    with signed_in(cut_off, t.key) as client:
        relay.block()
        try:
            r = client.post("/dashboard/logout")
        finally:
            relay.unblock()
        assert r.status_code == 503 and "could not be ended on the server" in r.text
        assert COOKIE not in client.cookies
