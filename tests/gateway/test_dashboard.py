"""The quota dashboard: a tenant signs in with its API key and sees exactly the usage API's numbers
for itself and nothing of another tenant; an admin sees every tenant; the session cookie is
HttpOnly, SameSite=Strict and short-lived, and a tampered or expired one is refused."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import jwt
import pytest
from playwright.sync_api import Locator, Page, sync_playwright

from bench.usage_workload import CHROMIUM_ARGS
from loramux.gateway.dashboard.charts import Series, axis_top, stacked_bars
from loramux.gateway.dashboard.html import el
from loramux.gateway.dashboard.session import COOKIE, SESSION_SECONDS, Viewer, mint, signing_key
from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import json_of
from tests.gateway.tenants import TenantKey, new_key, new_tenant

ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
PROMPTS = ["Hello there", "What is LoRA?", "Count to three", "Hello there"]


@dataclass(frozen=True)
class Traffic:
    a: TenantKey
    b: TenantKey


def chat(gateway: RunningServer, key: str, prompt: str) -> None:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": prompt}]}
    headers = {"authorization": f"Bearer {key}"}
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body | {"max_tokens": 5},
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def operator(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    headers = {"authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def traffic(gateway: RunningServer, operator: httpx.Client) -> Traffic:
    """Tenant A (a daily token budget, a key limit, four chats) and tenant B (one chat)."""
    a, b = new_tenant(operator, "dash-a"), new_tenant(operator, "dash-b")
    quota = {"rpm": 1000, "token_budget": 1_000_000, "budget_period": "day"}
    assert operator.put(f"/admin/tenants/{a.tenant_id}/quotas", json=quota).status_code == 200
    assert operator.put(f"/admin/keys/{a.key_id}/quotas", json={"tpm": 50_000}).status_code == 200
    for prompt in PROMPTS:
        chat(gateway, a.key, prompt)
    chat(gateway, b.key, "Tenant B's secret prompt")
    gateway.run(gateway.state.usage.flush())
    return Traffic(a, b)


def usage_by_adapter(operator: httpx.Client, tenant_id: str, since: str) -> dict[str, dict]:
    r = operator.get(
        "/admin/usage", params={"tenant": tenant_id, "group_by": "adapter", "from": since}
    )
    return {row["group"]: row for row in json_of(r)["rows"]}


@contextlib.contextmanager
def signed_in(gateway: RunningServer, credential: str) -> Iterator[httpx.Client]:
    """A client holding the session cookie of `credential`."""
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        r = client.post("/dashboard/login", data={"credential": credential})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard", r.text
        yield client


def number(scope: Page | Locator, selector: str) -> int:
    """The integer shown by the element at `selector` (written with thousands separators)."""
    return int(scope.locator(selector).inner_text().replace(",", ""))


@pytest.mark.skipif(
    shutil.which("chromium") is None and not os.environ.get("CI"),
    reason="Chromium is not installed (apt-get install chromium)",
)
def test_a_tenant_sees_the_usage_apis_numbers_in_a_real_browser(
    gateway: RunningServer, operator: httpx.Client, traffic: Traffic
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium"), headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{gateway.url}/dashboard")
        page.fill("[data-testid=credential]", traffic.a.key)
        page.click("[data-testid=sign-in]")
        page.wait_for_selector("[data-testid=total-requests]")
        assert page.inner_text("[data-testid=tenant-name]") == traffic.a.tenant_name
        since = (datetime.now(UTC) - timedelta(days=29)).strftime("%Y-%m-%d")
        truth = usage_by_adapter(operator, traffic.a.tenant_id, since)
        assert number(page, "[data-testid=total-requests]") == len(PROMPTS)
        rows = page.locator("[data-testid=breakdown-row]").all()
        assert len(rows) == len(truth)
        fields = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_hits")
        for field in (*fields, "aborts", "client_errors", "server_errors"):
            testid = field.replace("_", "-")
            assert number(page, f"[data-testid=total-{testid}]") == sum(
                r[field] for r in truth.values()
            )
            for row in rows:
                group = row.locator("[data-testid=group]").inner_text()
                assert number(row, f"[data-testid={testid}]") == truth[group][field]
        assert number(page, "[data-testid=budget-used]") == sum(
            r["prompt_tokens"] + r["completion_tokens"] for r in truth.values()
        )
        cookie = next(c for c in page.context.cookies() if c["name"] == COOKIE)
        assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (
            True,
            "Strict",
            "/dashboard",
        )
        assert traffic.b.tenant_name not in page.content()
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        refused = page.goto(f"{gateway.url}/dashboard?tenant={traffic.b.tenant_id}")
        assert refused is not None and refused.status == 403
        assert traffic.b.tenant_name not in page.content()
        browser.close()


def test_the_session_cookie_is_httponly_strict_and_short_lived(
    gateway: RunningServer, traffic: Traffic
) -> None:
    r = httpx.post(f"{gateway.url}/dashboard/login", data={"credential": traffic.a.key})
    attributes = {p.strip().split("=")[0].lower(): p for p in r.headers["set-cookie"].split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= attributes.keys()
    assert "secure" not in attributes  # plain http here; set over https
    assert attributes["samesite"].split("=")[1].lower() == "strict"
    assert 0 < int(attributes["max-age"].split("=")[1]) <= SESSION_SECONDS


def test_a_tenant_cannot_see_another_tenants_data(gateway: RunningServer, traffic: Traffic) -> None:
    with signed_in(gateway, traffic.a.key) as client:
        own = json_of(client.get("/dashboard/data"))
        assert own["tenant"]["id"] == traffic.a.tenant_id
        assert own["totals"]["requests"] == len(PROMPTS)
        for path in ("/dashboard/data", "/dashboard"):
            r = client.get(path, params={"tenant": traffic.b.tenant_id})
            assert r.status_code == 403
            assert traffic.b.tenant_name not in r.text


def test_a_tenant_names_itself_by_id_or_name_and_no_other(
    gateway: RunningServer, traffic: Traffic
) -> None:
    """A tenant is addressed by id or name wherever one is taken: its own name in `?tenant=`
    was refused 403. Another tenant's name still is, in the very words a name no tenant has
    gets, so the refusal says nothing of whether that tenant exists."""
    with signed_in(gateway, traffic.a.key) as client:
        for ref in (traffic.a.tenant_id, traffic.a.tenant_name):
            own = client.get("/dashboard/data", params={"tenant": ref})
            assert own.status_code == 200, own.text
            assert json_of(own)["tenant"]["id"] == traffic.a.tenant_id
        refusals = []
        for ref in (traffic.b.tenant_name, traffic.b.tenant_id, "no-such-tenant-name"):
            r = client.get("/dashboard/data", params={"tenant": ref})
            assert r.status_code == 403, r.text
            refusals.append(json_of(r)["error"])
    assert refusals[0] == refusals[1] == refusals[2]
    assert refusals[0]["code"] == "not_your_tenant"


def test_an_admin_sees_every_tenant(
    gateway: RunningServer, admin_token: str, traffic: Traffic
) -> None:
    with signed_in(gateway, admin_token) as client:
        everyone = json_of(client.get("/dashboard/data"))
        assert everyone["tenant"] is None
        groups = {row["group"] for row in everyone["breakdown"]}
        assert {traffic.a.tenant_name, traffic.b.tenant_name} <= groups
        b = json_of(client.get("/dashboard/data", params={"tenant": traffic.b.tenant_id}))
        assert b["totals"]["requests"] == 1
        page = client.get("/dashboard", params={"tenant": traffic.a.tenant_id}).text
        assert f'value="{traffic.b.tenant_id}"' in page  # the tenant picker


def test_an_admin_picks_a_tenant_by_id_or_name(
    gateway: RunningServer, admin_token: str, traffic: Traffic
) -> None:
    """As wherever a tenant is taken (docs/architecture.md), and as the usage API takes it."""
    with signed_in(gateway, admin_token) as client:
        for ref in (traffic.b.tenant_id, traffic.b.tenant_name):
            shown = json_of(client.get("/dashboard/data", params={"tenant": ref}))
            assert shown["tenant"]["id"] == traffic.b.tenant_id
            assert shown["totals"]["requests"] == 1
        page = client.get("/dashboard", params={"tenant": traffic.b.tenant_name})
        assert page.status_code == 200 and traffic.b.tenant_name in page.text
        assert client.get("/dashboard/data", params={"tenant": "no-such"}).status_code == 404


@pytest.mark.parametrize("path", ["/dashboard/data", "/dashboard"])
def test_an_admins_tenant_holding_nul_is_refused_before_any_query_on_either_database(
    each_gateway: RunningServer, path: str
) -> None:
    """No reference holds NUL, answered alike on SQLite and PostgreSQL (docs/architecture.md);
    a tenant that is not there is named back at most 100 characters long."""
    token = each_gateway.state.admin.mint("nul-admin", ttl_seconds=600)
    with signed_in(each_gateway, token) as client:
        refused = client.get(path, params={"tenant": "acme\x00"})
        assert refused.status_code == 400, refused.text
        assert json_of(refused)["error"]["param"] == "tenant"
        missing = client.get(path, params={"tenant": "no-such-" + "x" * 300})
        assert missing.status_code == 404, missing.text
        assert "no-such-" + "x" * 92 + "'" in json_of(missing)["error"]["message"]


def refused(client: httpx.Client, cookie: str) -> None:
    client.cookies.set(COOKIE, cookie, path="/dashboard")
    page = client.get("/dashboard")
    assert page.status_code == 401 and 'data-testid="sign-in-error"' in page.text
    assert "total-requests" not in page.text
    assert client.get("/dashboard/data").status_code == 401


def test_a_tampered_expired_or_foreign_cookie_is_refused(
    gateway: RunningServer, admin_token: str, traffic: Traffic
) -> None:
    with signed_in(gateway, traffic.a.key) as client:
        good = client.cookies[COOKIE]
        header, claims, signature = good.split(".")
        refused(
            client,
            f"{header}.{claims}.{signature[:-3]}{'AAA' if signature[-3:] != 'AAA' else 'BBB'}",
        )
        forged = jwt.decode(good, options={"verify_signature": False}) | {
            "tenant": traffic.b.tenant_id
        }
        refused(client, jwt.encode(forged, "x" * 64, algorithm="HS256"))
        a_viewer = Viewer(traffic.a.key_id, traffic.a.tenant_id, int(time.time()) - 5, "s")
        refused(client, mint(DashboardSources.of(gateway.state), a_viewer))  # expired
        refused(client, admin_token)  # an admin token is not a session
        other_audience = jwt.decode(good, options={"verify_signature": False}) | {
            "aud": "loramux-admin"
        }
        refused(
            client,
            jwt.encode(
                other_audience, signing_key(DashboardSources.of(gateway.state)), algorithm="HS256"
            ),
        )


def test_a_revoked_key_ends_its_session(gateway: RunningServer, operator: httpx.Client) -> None:
    tenant = new_tenant(operator, "dash-revoked")
    with signed_in(gateway, tenant.key) as client:
        assert client.get("/dashboard/data").status_code == 200
        assert operator.delete(f"/admin/keys/{tenant.key_id}").status_code == 200
        assert client.get("/dashboard/data").status_code == 401


def test_a_revoked_keys_usage_stays_marked_revoked(
    gateway: RunningServer, operator: httpx.Client
) -> None:
    """A revoked key keeps its row (and its usage); the per-key table says it is revoked."""
    t = new_tenant(operator, "dash-revoked-row")
    old_id, old_key = new_key(operator, t.tenant_id, name="laptop")
    chat(gateway, old_key, "Hello there")
    gateway.run(gateway.state.usage.flush())
    assert operator.delete(f"/admin/keys/{old_id}").status_code == 200
    with signed_in(gateway, t.key) as client:
        keys = {k["key"]: k for k in json_of(client.get("/dashboard/data"))["keys"]}
        page = client.get("/dashboard").text
    old = keys[f"lmx-{old_id} (laptop)"]
    assert old["revoked"] is True and old["deleted"] is False and old["requests"] == 1
    row = page[page.index(f"lmx-{old_id} (laptop)") :]
    assert "(revoked)" in row[: row.index("</tr>")]


def test_sign_in_refuses_bad_credentials_and_other_origins(
    gateway: RunningServer, traffic: Traffic
) -> None:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        bad = client.post("/dashboard/login", data={"credential": "lmx-nope"})
        assert bad.status_code == 401 and COOKIE not in client.cookies
        cross = client.post(
            "/dashboard/login",
            data={"credential": traffic.a.key},
            headers={"origin": "https://evil.example"},
        )
        assert cross.status_code == 403 and COOKIE not in client.cookies
        assert client.get("/dashboard").status_code == 200  # the sign-in form


def test_an_admin_token_past_its_exp_is_refused_at_sign_in_saying_so(
    gateway: RunningServer,
) -> None:
    """The admin API takes a token up to the clock skew past its `exp`; a session would end at
    that `exp`, before it began (a cookie of Max-Age 0): sign-in refuses it instead."""
    token = gateway.state.admin.mint("skewed-admin", ttl_seconds=-10)
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        api = client.get("/admin/tenants", headers={"authorization": f"Bearer {token}"})
        assert api.status_code == 200, api.text
        r = client.post("/dashboard/login", data={"credential": token})
        assert r.status_code == 401 and COOKIE not in client.cookies
        assert 'data-testid="sign-in-error"' in r.text and "admin token expired" in r.text


def test_every_dashboard_response_forbids_caching_and_sniffing(
    gateway: RunningServer, traffic: Traffic
) -> None:
    with httpx.Client(base_url=gateway.url, timeout=60) as anonymous:
        responses = [
            anonymous.get("/dashboard"),
            anonymous.get("/dashboard/data"),
            anonymous.get("/dashboard/style.css"),
            anonymous.post("/dashboard/login", data={"credential": "lmx-nope"}),
            anonymous.post("/dashboard/login", headers={"origin": "https://evil.example"}),
            anonymous.get("/dashboard/no-such-page"),  # 404: no dashboard route answers it
            anonymous.delete("/dashboard"),  # 405
        ]
    with signed_in(gateway, traffic.a.key) as client:
        responses += [
            client.get("/dashboard"),
            client.get("/dashboard/data"),
            client.get("/dashboard/data", params={"days": 0}),
            client.get("/dashboard/data", params={"tenant": traffic.b.tenant_id}),
            client.post("/dashboard/logout"),
        ]
    statuses = sorted({r.status_code for r in responses})
    assert statuses == [200, 303, 400, 401, 403, 404, 405]
    for r in responses:
        assert r.headers.get("cache-control") == "no-store", (r.request.url, r.status_code)
        assert r.headers.get("x-content-type-options") == "nosniff", (r.request.url, r.status_code)
        policy = r.headers.get("content-security-policy", "")
        directives = {d.strip().split(" ", 1)[0]: d.strip() for d in policy.split(";")}
        assert directives["default-src"] == "default-src 'none'", policy
        assert directives["style-src"] == "style-src 'self'", policy
        assert directives["frame-ancestors"] == "frame-ancestors 'none'", policy


def test_sign_out_clears_the_session(gateway: RunningServer, traffic: Traffic) -> None:
    with signed_in(gateway, traffic.a.key) as client:
        r = client.post("/dashboard/logout")
        assert r.status_code == 303 and COOKIE not in client.cookies
        assert client.get("/dashboard/data").status_code == 401


@pytest.mark.parametrize("who", ["tenant", "admin"])
def test_sign_out_ends_the_session_not_only_the_browsers_copy(
    gateway: RunningServer, admin_token: str, traffic: Traffic, who: str
) -> None:
    """A copy of the cookie (a shared computer's disk, a proxy's log) is refused once its
    session signed out; another session of the same credential goes on."""
    credential = traffic.a.key if who == "tenant" else admin_token
    with signed_in(gateway, credential) as other, signed_in(gateway, credential) as client:
        copy = client.cookies[COOKIE]
        assert client.post("/dashboard/logout").status_code == 303
        with httpx.Client(base_url=gateway.url, timeout=60) as replay:
            refused(replay, copy)
        assert other.get("/dashboard/data").status_code == 200


def test_names_are_escaped(
    gateway: RunningServer, operator: httpx.Client, admin_token: str
) -> None:
    new_tenant(operator, "<img src=x onerror=alert(1)>")
    with signed_in(gateway, admin_token) as client:
        page = client.get("/dashboard").text
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def test_markup_escapes_text_and_attribute_values_by_construction() -> None:
    hostile = '"><script>alert(1)</script>'
    assert el("td", hostile, title=hostile) == (
        '<td title="&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;">'
        "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;</td>"
    )
    assert el("p", el("b", "<b>"), 3, None) == "<p><b>&lt;b&gt;</b>3</p>"
    assert el("input", required=True, disabled=False, data_testid="x") == (
        '<input required data-testid="x">'
    )


def test_a_chart_is_svg_with_a_round_axis_and_escaped_labels() -> None:
    svg = stacked_bars(["<day>", "b"], [Series("<s>", "#000", [3, None])], "Requests", "req")
    assert svg.count("<rect") == 2  # one bar, and the legend's swatch
    assert "&lt;day&gt;" in svg and "<day>" not in svg and "&lt;s&gt;" in svg
    assert [axis_top(v, whole=True) for v in (0, 3, 5, 79)] == [4, 4, 8, 80]
