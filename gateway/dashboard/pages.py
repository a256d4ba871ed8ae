"""The dashboard's pages: sign-in and the usage page, as HTML built by `gateway.dashboard.html`.

The pages carry no script at all; forms do the rest (sign in, sign out, pick a tenant and a
window). Numbers a test or a person may check carry `data-testid` attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from loramux.gateway.dashboard.charts import Series, lines, stacked_bars
from loramux.gateway.dashboard.html import Child, Html, el
from loramux.gateway.dashboard.panels import (
    REFRESH_SECONDS,
    cache_panel,
    engine_panel,
    live_panel,
    percent,
    tenant_quota_panel,
)
from loramux.gateway.dashboard.session import Viewer
from loramux.gateway.dashboard.view import Breakdown, DashboardView
from loramux.gateway.db import UsageTotals

WINDOWS = (1, 7, 30, 90)
"""Windows (days) offered by the page's selector."""
BLUE, TEAL, RED, ORANGE = "#3867d6", "#20bf6b", "#eb3b5a", "#fa8231"
GREY, PURPLE = "#778ca3", "#8854d0"
REFUSAL_NAMES = {
    "refused_requests": "rpm",
    "refused_tokens": "tpm",
    "refused_concurrency": "concurrency",
    "refused_budget": "budget",
    "refused_backlog": "backlog",
}


def document(title: str, *body: Child, refresh: int | None = None) -> Html:
    head = el(
        "head",
        el("meta", charset="utf-8"),
        el("meta", http_equiv="refresh", content=refresh) if refresh else None,
        el("meta", name="viewport", content="width=device-width, initial-scale=1"),
        el("title", title),
        el("link", rel="stylesheet", href="/dashboard/style.css"),
    )
    return Html("<!doctype html>" + el("html", head, el("body", *body), lang="en"))


def sign_in_page(message: str | None = None) -> Html:
    form = el(
        "form",
        el("label", "API key or admin token", for_="credential"),
        el(
            "input",
            id="credential",
            name="credential",
            type="password",
            required=True,
            autocomplete="off",
            placeholder="lmx-…",
            data_testid="credential",
        ),
        el("button", "Sign in", type="submit", data_testid="sign-in"),
        method="post",
        action="/dashboard/login",
        class_="sign-in",
    )
    notice = el("p", message, class_="error", data_testid="sign-in-error") if message else None
    intro = el("p", "Paste an API key to see your usage, or an admin token to see every tenant.")
    card = el("main", el("h1", "loramux usage"), intro, notice, form, class_="card narrow")
    return document("Sign in · loramux", card)


def dashboard_page(view: DashboardView, viewer: Viewer) -> Html:
    name = view.tenant.name if view.tenant else "All tenants"
    return document(
        f"{name} · loramux usage",
        _header(view, viewer),
        el(
            "main",
            live_panel(view.current, view.live) if view.tenant else None,
            engine_panel(view.engines) if viewer.is_admin else None,
            tenant_quota_panel(view.current) if viewer.is_admin and not view.tenant else None,
            _summary(view.totals),
            _charts(view),
            _breakdown(view),
            _key_breakdown(view.keys) if view.tenant else None,
            cache_panel(view.cache) if view.cache is not None else None,
        ),
        refresh=REFRESH_SECONDS if view.live else None,
    )


def _header(view: DashboardView, viewer: Viewer) -> Html:
    who = "admin " + viewer.subject if viewer.is_admin else f"key lmx-{viewer.subject}"
    ends = datetime.fromtimestamp(viewer.expires_at, UTC).strftime("%H:%M UTC")
    picker = _tenant_picker(view) if viewer.is_admin else []
    picker += _window_picker(view)
    window = view.window
    end = window.last.isoformat()
    return el(
        "header",
        el("h1", view.tenant.name if view.tenant else "All tenants", data_testid="tenant-name"),
        el(
            "p",
            el("span", f"{window.first.isoformat()} to {end}", data_testid="window"),
            f" (UTC) · signed in as {who} until {ends}",
        ),
        el("form", picker, method="get", action="/dashboard", class_="picker"),
        el(
            "form",
            el("button", "Sign out", type="submit", data_testid="sign-out"),
            method="post",
            action="/dashboard/logout",
        ),
    )


def _tenant_picker(view: DashboardView) -> list[Child]:
    options = [el("option", "All tenants", value="", selected=view.tenant is None)]
    options += [
        el(
            "option",
            t.name,
            value=t.id,
            selected=view.tenant is not None and t.id == view.tenant.id,
        )
        for t in view.tenants
    ]
    return [el("select", options, name="tenant", data_testid="tenant-picker")]


def _window_picker(view: DashboardView) -> list[Child]:
    windows = [
        el("option", f"last {d} days" if d > 1 else "today", value=d, selected=d == view.days)
        for d in WINDOWS
    ]
    window = view.window
    # The dates are filled in only for a custom window: filled, they would override the
    # preset picked next (the form sends both).
    first, last = (
        (window.first.isoformat(), window.last.isoformat()) if window.custom else (None, None)
    )
    return [
        el("select", windows, name="days"),
        el(
            "label",
            "from",
            el("input", type="date", name="from", value=first, data_testid="from"),
        ),
        el(
            "label",
            "to",
            el("input", type="date", name="to", value=last, data_testid="to"),
        ),
        el(
            "label",
            el("input", type="checkbox", name="paused", value="true", checked=not view.live),
            " pause refresh",
        ),
        el("button", "Show", type="submit", data_testid="show"),
    ]


def _number(value: int) -> str:
    return f"{value:,}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} ms"


def _card(label: str, value: str, testid: str, note: str | None = None) -> Html:
    return el(
        "div",
        el("span", label),
        el("strong", value, data_testid=testid),
        el("small", note) if note else None,
        class_="stat",
    )


def _refusal_note(t: UsageTotals) -> str:
    """429s by limit, e.g. `2 rpm, 1 budget`."""
    parts = [
        f"{getattr(t, name):,} {short}" for name, short in REFUSAL_NAMES.items() if getattr(t, name)
    ]
    return "429: " + (", ".join(parts) if parts else "none")


def _summary(t: UsageTotals) -> Html:
    hits = f"{t.exact_hits:,} exact, {t.semantic_hits:,} semantic"
    return el(
        "section",
        _card("Requests", _number(t.requests), "total-requests"),
        _card("Prompt tokens", _number(t.prompt_tokens), "total-prompt-tokens"),
        _card("Completion tokens", _number(t.completion_tokens), "total-completion-tokens"),
        _card("Cached tokens", _number(t.cached_tokens), "total-cached-tokens"),
        _card("Cache hits", _number(t.cache_hits), "total-cache-hits", hits),
        _card("Cache hit rate", percent(t.cache_hit_rate), "cache-hit-rate"),
        _card("Client aborts", _number(t.aborts), "total-aborts", "the client left first (499)"),
        _card("Refusals", _number(t.refusals), "total-refusals", _refusal_note(t)),
        _card("Client errors", _number(t.client_errors), "total-client-errors", "other 4xx"),
        _card("Server errors", _number(t.server_errors), "total-server-errors", "5xx"),
        _card(
            "Latency p50",
            _ms(t.latency_percentile(0.5)),
            "latency-p50",
            f"mean {_ms(t.mean_latency_ms if t.requests else None)}",
        ),
        _card("Latency p90", _ms(t.latency_percentile(0.9)), "latency-p90"),
        _card("Latency p99", _ms(t.latency_percentile(0.99)), "latency-p99"),
        _card("Time to first token p50", _ms(t.ttft_percentile(0.5)), "ttft-p50"),
        _card("Time to first token p99", _ms(t.ttft_percentile(0.99)), "ttft-p99"),
        class_="stats",
    )


def _charts(view: DashboardView) -> Html:
    days = [d.label[5:] for d in view.daily]
    hours = [h.label[11:] for h in view.hourly]
    return el(
        "section",
        stacked_bars(days, _request_series(view.daily), "Requests per day", "requests"),
        stacked_bars(days, _token_series(view.daily), "Tokens per day", "tokens"),
        stacked_bars(hours, _request_series(view.hourly), "Requests, last 24 hours", "requests"),
        lines(days, _latency_series(view.daily), "Latency per day", "ms"),
        class_="charts",
    )


def _request_series(buckets: Sequence[Breakdown]) -> list[Series]:
    t = [b.totals for b in buckets]
    served = [max(x.requests - x.errors - x.cache_hits, 0) for x in t]
    return [
        Series("engine", BLUE, served),
        Series("cache hits", TEAL, [x.cache_hits for x in t]),
        Series("client aborts", GREY, [x.aborts for x in t]),
        Series("refusals (429)", ORANGE, [x.refusals for x in t]),
        Series("client errors (4xx)", PURPLE, [x.client_errors for x in t]),
        Series("server errors (5xx)", RED, [x.server_errors for x in t]),
    ]


def _token_series(buckets: Sequence[Breakdown]) -> list[Series]:
    t = [b.totals for b in buckets]
    return [
        Series("prompt", BLUE, [x.prompt_tokens for x in t]),
        Series("completion", ORANGE, [x.completion_tokens for x in t]),
    ]


def _latency_series(buckets: Sequence[Breakdown]) -> list[Series]:
    t = [b.totals for b in buckets]
    return [
        Series(f"p{round(q * 100)}", color, [x.latency_percentile(q) for x in t])
        for q, color in ((0.5, TEAL), (0.9, ORANGE), (0.99, RED))
    ]


def _breakdown(view: DashboardView) -> Html:
    title = "Per adapter" if view.tenant else "Per tenant"
    columns = (
        "Requests",
        "Prompt tokens",
        "Completion tokens",
        "Cached tokens",
        "Cache hits",
        "Hit rate",
        "Aborts",
        "Refusals",
        "Client errors",
        "Server errors",
        "p50",
        "p99",
    )
    head = el("tr", el("th", "Model" if view.tenant else "Tenant"), [el("th", c) for c in columns])
    rows = [_breakdown_row(b) for b in view.breakdown]
    empty = el("tr", el("td", "No requests in this window.", colspan=14)) if not rows else None
    return el("section", el("h2", title), el("table", head, rows, empty), class_="card")


def _breakdown_row(b: Breakdown) -> Html:
    t = b.totals
    cells = (
        ("requests", _number(t.requests)),
        ("prompt-tokens", _number(t.prompt_tokens)),
        ("completion-tokens", _number(t.completion_tokens)),
        ("cached-tokens", _number(t.cached_tokens)),
        ("cache-hits", _number(t.cache_hits)),
        ("cache-hit-rate", percent(t.cache_hit_rate)),
        ("aborts", _number(t.aborts)),
        ("refusals", _number(t.refusals)),
        ("client-errors", _number(t.client_errors)),
        ("server-errors", _number(t.server_errors)),
        ("latency-p50", _ms(t.latency_percentile(0.5))),
        ("latency-p99", _ms(t.latency_percentile(0.99))),
    )
    deleted = el("small", " (deleted)", data_testid="deleted") if b.deleted else None
    return el(
        "tr",
        el("td", el("span", b.label, data_testid="group"), deleted),
        [el("td", value, data_testid=testid) for testid, value in cells],
        data_testid="breakdown-row",
    )


def _key_state(k: Breakdown) -> Html | None:
    """A revoked key (its row stays) or a key whose row is gone, marked as such."""
    if k.revoked:
        return el("small", " (revoked)", data_testid="revoked")
    return el("small", " (deleted)", data_testid="deleted") if k.deleted else None


def _key_breakdown(keys: Sequence[Breakdown]) -> Html:
    head = el(
        "tr", el("th", "Key"), el("th", "Requests"), el("th", "Tokens"), el("th", "Aborts"),
        el("th", "Refusals"), el("th", "Client errors"), el("th", "Server errors"),
    )  # fmt: skip
    rows = [
        el(
            "tr",
            el(
                "td",
                k.label,
                _key_state(k),
                data_testid="key",
            ),
            el("td", _number(k.totals.requests), data_testid="requests"),
            el("td", _number(k.totals.total_tokens)),
            el("td", _number(k.totals.aborts)),
            el("td", _number(k.totals.refusals)),
            el("td", _number(k.totals.client_errors)),
            el("td", _number(k.totals.server_errors)),
            data_testid="key-row",
        )
        for k in keys
    ]
    empty = el("tr", el("td", "No requests in this window.", colspan=7)) if not rows else None
    return el("section", el("h2", "Per key"), el("table", head, rows, empty), class_="card")
