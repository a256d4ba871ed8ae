"""The dashboard tells outcomes apart: a client that aborts shows aborts, not errors; 429s show
as refusals by limit; bad bodies and unknown models as client errors. One adapter is one row
however requests named it, deleted adapters are marked, windows may be any range of days, the
live panel shows a request in flight and the limits' use now, and a tenant sees only its own
key's limits."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from bench.usage_workload import CHROMIUM_ARGS
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of
from tests.gateway.serve_process import wait_for
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter
from tests.gateway.test_dashboard import number, signed_in

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 4}


@dataclass(frozen=True)
class Mixed:
    tenant: TenantKey
    other_key_id: str
    other_key: str


def chat(gateway: RunningServer, key: str, model: str, **extra: object) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=CHAT | {"model": model} | extra,
        headers={"authorization": f"Bearer {key}", "cache-control": "no-store"},
        timeout=120,
    )


def abort_a_stream(gateway: RunningServer, key: str, model: str) -> None:
    """Start a long stream, read its first chunk, then leave."""
    body = CHAT | {"model": model, "stream": True, "max_tokens": 400}
    headers = {"authorization": f"Bearer {key}"}
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers
        ) as r,
    ):
        assert r.status_code == 200, r.read()
        next(r.iter_lines())


def usage(operator: httpx.Client, tenant_id: str) -> dict:
    rows = json_of(operator.get("/admin/usage", params={"tenant": tenant_id, "group_by": "key"}))
    return {r["group"]: r for r in rows["rows"]}


@pytest.fixture(scope="module")
def operator(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def mixed(
    gateway: RunningServer,
    operator: httpx.Client,
    demo_adapter_dirs: list[Path],
    overflowing_adapter: Path,
) -> Mixed:
    """Key A: two chats on one adapter named two ways, an abort, then a 429 (rpm 3). Key B: a
    400, a 404, a 500 (an adapter whose logits overflow: the engine fails that request alone),
    and a chat on an adapter deleted afterwards."""
    t = new_tenant(operator, "outcomes")
    other_id, other = new_key(operator, t.tenant_id, name="other")
    for path, quota in (
        (f"/admin/tenants/{t.tenant_id}/quotas", {"max_concurrent": 4}),
        (f"/admin/keys/{t.key_id}/quotas", {"rpm": 3}),
        (f"/admin/keys/{other_id}/quotas", {"tpm": 777_777}),
    ):
        assert operator.put(path, json=quota).status_code == 200
    upload_adapter(operator, t.tenant_id, "support-bot", demo_adapter_dirs[20])
    upload_adapter(operator, t.tenant_id, "old-bot", demo_adapter_dirs[21])
    upload_adapter(operator, t.tenant_id, "broken-bot", overflowing_adapter)
    assert chat(gateway, t.key, "support-bot").status_code == 200
    assert chat(gateway, t.key, f"{t.tenant_name}/support-bot@1").status_code == 200
    abort_a_stream(gateway, t.key, "support-bot")
    refused = chat(gateway, t.key, "support-bot")
    assert refused.status_code == 429, refused.text
    assert chat(gateway, other, "support-bot", max_tokens=-1).status_code == 400
    assert chat(gateway, other, "no-such-bot").status_code == 404
    failed = chat(gateway, other, "broken-bot")
    assert failed.status_code == 500, failed.text
    assert chat(gateway, other, "old-bot").status_code == 200
    assert operator.delete(f"/admin/adapters/{t.tenant_id}/old-bot").status_code == 200

    def all_recorded() -> bool:
        gateway.run(gateway.state.usage.flush())
        return sum(r["requests"] for r in usage(operator, t.tenant_id).values()) == 8

    wait_for(all_recorded, 30, "the eight requests are recorded")
    return Mixed(t, other_id, other)


def test_the_usage_api_counts_each_outcome_apart(operator: httpx.Client, mixed: Mixed) -> None:
    by_key = usage(operator, mixed.tenant.tenant_id)
    a, b = by_key[mixed.tenant.key_id], by_key[mixed.other_key_id]
    assert (a["requests"], a["aborts"], a["client_errors"], a["server_errors"]) == (4, 1, 0, 0)
    assert a["refusals"] == {
        "requests": 1,
        "tokens": 0,
        "concurrency": 0,
        "budget": 0,
        "backlog": 0,
    }
    assert (b["requests"], b["aborts"], b["client_errors"], sum(b["refusals"].values())) == (
        4, 0, 2, 0,
    )  # fmt: skip
    assert b["server_errors"] == 1
    assert a["errors"] == 2 and b["errors"] == 3


def test_a_refusal_after_its_model_resolved_is_counted_with_that_adapter(
    operator: httpx.Client, mixed: Mixed
) -> None:
    """The 429 came after `support-bot` resolved: it is that adapter's refusal, beside its
    requests, not a request of no model (found by attacking billing: it was recorded as "").
    The 400 and the 404 never resolved a model, and stay under none."""
    rows = operator.get(
        "/admin/usage", params={"tenant": mixed.tenant.tenant_id, "group_by": "adapter"}
    )
    by_adapter = {r["group"]: r for r in json_of(rows)["rows"]}
    assert by_adapter["support-bot"]["requests"] == 4
    assert by_adapter["support-bot"]["refusals"]["requests"] == 1
    assert by_adapter[""]["requests"] == 2 and by_adapter[""]["client_errors"] == 2


@pytest.mark.skipif(
    shutil.which("chromium") is None and not os.environ.get("CI"),
    reason="Chromium is not installed (apt-get install chromium)",
)
def test_outcomes_adapters_and_key_limits_in_a_real_browser(
    gateway: RunningServer, mixed: Mixed
) -> None:
    t = mixed.tenant
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{gateway.url}/dashboard?days=1")
            page.fill("[data-testid=credential]", t.key)
            page.click("[data-testid=sign-in]")
            page.wait_for_selector("[data-testid=total-requests]")
            assert number(page, "[data-testid=total-requests]") == 8
            assert number(page, "[data-testid=total-aborts]") == 1
            assert number(page, "[data-testid=total-refusals]") == 1
            assert number(page, "[data-testid=total-client-errors]") == 2
            assert number(page, "[data-testid=total-server-errors]") == 1
            rows = {
                row.locator("[data-testid=group]").inner_text(): row
                for row in page.locator("[data-testid=breakdown-row]").all()
            }
            unresolved = "(no model)"
            assert set(rows) == {"support-bot", "old-bot", "broken-bot", unresolved}
            assert number(rows["broken-bot"], "[data-testid=server-errors]") == 1
            assert number(rows["support-bot"], "[data-testid=requests]") == 4
            assert number(rows["support-bot"], "[data-testid=refusals]") == 1
            assert number(rows[unresolved], "[data-testid=client-errors]") == 2
            assert number(rows["support-bot"], "[data-testid=aborts]") == 1
            assert rows["old-bot"].locator("[data-testid=deleted]").count() == 1
            assert rows["support-bot"].locator("[data-testid=deleted]").count() == 0
            scopes = page.locator("[data-testid=quota-scope]").all_inner_texts()
            assert scopes == ["tenant", f"key lmx-{t.key_id}"]
            assert "777,777" not in page.content(), "key B's limit is not key A's business"
            keys = page.locator("[data-testid=key-row]").count()
            assert keys == 2, "a tenant sees its keys' usage, not their limits"
            page.fill("[data-testid=from]", "2026-01-01")
            page.fill("[data-testid=to]", "2026-01-31")
            page.click("[data-testid=show]")
            page.wait_for_selector("[data-testid=window]:has-text('2026-01-01 to 2026-01-31')")
            assert number(page, "[data-testid=total-requests]") == 0
        finally:
            browser.close()


def test_the_live_panel_shows_a_request_in_flight_and_use_against_limits(
    gateway: RunningServer, mixed: Mixed
) -> None:
    body = CHAT | {"model": "support-bot", "stream": True, "max_tokens": 400}
    headers = {"authorization": f"Bearer {mixed.other_key}"}
    with signed_in(gateway, mixed.other_key) as dashboard:
        seen = 0
        for _ in range(5):  # the demo model may end a stream before the page is read
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers
                ) as r,
            ):
                lines = r.iter_lines()
                next(lines)
                page = dashboard.get("/dashboard", params={"days": 1}).text
                seen = int(re.search(r'data-testid="in-flight">(\d+)<', page)[1])  # type: ignore[index]
                if seen == 1:
                    break
        assert seen == 1
        assert '<meta http-equiv="refresh" content="10">' in page
        used = re.findall(r'data-testid="quota-used">([\d,]+)<', page)
        assert len(used) == 2 and int(used[1].replace(",", "")) > 0  # in flight; tokens this minute
        paused = dashboard.get("/dashboard", params={"days": 1, "paused": "true"}).text
        assert 'http-equiv="refresh"' not in paused


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"from": "2026-13-01"}, 400),
        ({"from": "2026-11-20", "to": "2026-11-10"}, 400),
        ({"from": "2020-01-01", "to": "2026-11-10"}, 400),
        ({"from": "x" * 11}, 400),
        ({"from": "２０２６-11-01"}, 400),
    ],
)
def test_a_custom_range_that_is_not_a_window_of_days_is_refused(
    gateway: RunningServer, mixed: Mixed, params: dict, status: int
) -> None:
    with signed_in(gateway, mixed.tenant.key) as dashboard:
        assert dashboard.get("/dashboard", params=params).status_code == status


def test_a_custom_range_shows_those_days_only(
    gateway: RunningServer, operator: httpx.Client, mixed: Mixed
) -> None:
    with signed_in(gateway, mixed.tenant.key) as dashboard:
        past = dashboard.get("/dashboard", params={"from": "2026-01-01", "to": "2026-01-31"})
        assert past.status_code == 200
        assert 'data-testid="window">2026-01-01 to 2026-01-31<' in past.text
        assert 'data-testid="total-requests">0<' in past.text

        def agrees_with_the_usage_api() -> bool:
            """(Streams of other tests may still be recorded: read until both agree.)"""
            gateway.run(gateway.state.usage.flush())
            data = json_of(dashboard.get("/dashboard/data", params={"from": "2026-01-01"}))
            by_key = usage(operator, mixed.tenant.tenant_id).values()
            assert data["from"] == "2026-01-01"
            return data["totals"]["requests"] == sum(r["requests"] for r in by_key) >= 7

        wait_for(agrees_with_the_usage_api, 30, "the page and the usage API agree")


def test_an_admin_sees_engine_health_and_quota_use_across_tenants(
    gateway: RunningServer, admin_token: str, mixed: Mixed
) -> None:
    with signed_in(gateway, admin_token) as dashboard:
        page = dashboard.get("/dashboard", params={"days": 1}).text
    assert 'data-testid="engine-state">up<' in page
    assert re.search(r'data-testid="engine-kv">[\d.]+% of [\d,]+ blocks<', page)
    assert mixed.tenant.tenant_name in page and f"lmx-{mixed.other_key_id}" in page


def test_an_admin_sees_each_engine_at_its_index_while_one_before_it_is_down(
    two_engine_gateway: tuple[list[RunningEngineService], RunningServer],
) -> None:
    """Engine #0 down, #1 up: the panel showed one row, #0 up (engine 1's numbers)."""
    engines, gw = two_engine_gateway
    engines[0].stop()
    with signed_in(gw, gw.state.admin.mint("test-admin", ttl_seconds=600)) as dashboard:

        def states() -> list[tuple[str, str]]:
            page = dashboard.get("/dashboard", params={"days": 1}).text
            return re.findall(r'<td>#(\d+)</td><td data-testid="engine-state">(\w+)<', page)

        wait_for(lambda: states() == [("0", "down"), ("1", "up")], 30, "#0 down, #1 up")


def test_an_admin_sees_every_engine_down_when_all_are_down(
    two_engine_gateway: tuple[list[RunningEngineService], RunningServer],
) -> None:
    """Both engines of LORAMUX_ENGINE_URLS down: the panel showed a single row, #0 down, as if
    the gateway had one engine. Each engine keeps its row."""
    engines, gw = two_engine_gateway
    with signed_in(gw, gw.state.admin.mint("test-admin", ttl_seconds=600)) as dashboard:

        def states() -> list[tuple[str, str]]:
            page = dashboard.get("/dashboard", params={"days": 1}).text
            return re.findall(r'<td>#(\d+)</td><td data-testid="engine-state">(\w+)<', page)

        wait_for(lambda: states() == [("0", "up"), ("1", "up")], 30, "#0 up, #1 up")
        for engine in engines:
            engine.stop()
        wait_for(lambda: states() == [("0", "down"), ("1", "down")], 30, "#0 down, #1 down")


@pytest.mark.parametrize(
    "params", [{"to": "9999-12-31"}, {"from": "9999-12-31", "to": "9999-12-31"}]
)
def test_a_window_must_end_within_the_calendar(
    gateway: RunningServer, operator: httpx.Client, params: dict
) -> None:
    """A window ends at the midnight after its last day, which 9999-12-31 lacks: such a `to` is
    a 400 naming it, on the page and its data. Computing the window's end overflowed: a 500."""
    with signed_in(gateway, new_tenant(operator, "calendar").key) as dashboard:
        for path in ("/dashboard", "/dashboard/data"):
            response = dashboard.get(path, params=params)
            assert response.status_code == 400, (path, response.text)
            assert "9999-12-30" in response.text


def test_days_up_to_the_calendars_first_begin_with_it(
    gateway: RunningServer, operator: httpx.Client
) -> None:
    """The last 30 days up to 0001-01-05 are the five days from 0001-01-01: there are none
    before it. Counting back 30 days from it overflowed: a 500."""
    with signed_in(gateway, new_tenant(operator, "calendar").key) as dashboard:
        assert dashboard.get("/dashboard", params={"to": "0001-01-05"}).status_code == 200
        data = json_of(dashboard.get("/dashboard/data", params={"to": "0001-01-05"}))
    assert (data["from"], data["to"], data["days"]) == ("0001-01-01", "0001-01-05", 5)
