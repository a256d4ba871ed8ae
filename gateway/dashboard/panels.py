"""The dashboard's live panel and the admin's panels: limits against their use now, requests in
flight, the engines' health and the quota use of every tenant with limits.

The page refreshes itself with `<meta http-equiv="refresh">` while the live panel is on: no
script, so the page's CSP (`default-src 'none'`) stays as strict as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from loramux.cache.tenant_stats import TenantCacheStats
from loramux.gateway.dashboard.html import Child, Html, el
from loramux.gateway.dashboard.live import EngineHealth, LiveFigures, QuotaLine

REFRESH_SECONDS = 10
ORANGE, RED, TEAL = "#fa8231", "#eb3b5a", "#20bf6b"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def live_panel(current: LiveFigures, live: bool) -> Html:
    refresh = f"refreshes every {REFRESH_SECONDS} s" if live else "refresh off"
    return el(
        "section",
        el("h2", "Now"),
        _unavailable(current),
        el(
            "p",
            el("strong", _count(current.in_flight), data_testid="in-flight"),
            " requests in flight (holding a concurrency slot)",
            el("small", f" · {refresh}"),
        ),
        quota_table(current.quotas),
        class_="card",
        data_testid="live-panel",
    )


def _unavailable(current: LiveFigures) -> Html | None:
    """The notice of a page whose live figures the quota Redis did not give."""
    if current.available:
        return None
    return el(
        "p",
        "Live figures are unavailable: the quota service did not answer. Usage and budgets "
        "below are read from the usage records and are up to date.",
        class_="error",
        data_testid="live-unavailable",
    )


def _count(n: int | None) -> str:
    return "—" if n is None else f"{n:,}"


def quota_table(quotas: Sequence[QuotaLine]) -> Html:
    if not quotas:
        return el("p", "No limits are set.")
    head = el("tr", el("th", "Applies to"), el("th", "Limit"), el("th", "Used"), el("th", ""))
    rows = [
        el(
            "tr",
            el("td", q.scope, data_testid="quota-scope"),
            el("td", f"{q.value:,} {q.limit}", data_testid="quota-limit"),
            el("td", _used(q)),
            el("td", _meter(q.fraction)),
            data_testid="quota-row",
        )
        for q in quotas
    ]
    return el("table", head, rows)


def _used(q: QuotaLine) -> Child:
    testid = "budget-used" if q.period in ("day", "month") else "quota-used"
    when = {"minute": " in the last minute", "now": " now"}.get(q.period, f" this {q.period}")
    return [el("span", _count(q.used), data_testid=testid), when]


def _meter(fraction: float) -> Html:
    color = RED if fraction >= 0.9 else ORANGE if fraction >= 0.7 else TEAL
    return el(
        "svg",
        el("rect", width=160, height=10, fill="#e3e8ee", rx=3),
        el("rect", width=f"{160 * fraction:.1f}", height=10, fill=color, rx=3),
        el("title", percent(fraction)),
        width=160,
        height=10,
    )


def engine_panel(engines: Sequence[EngineHealth]) -> Html:
    head = el(
        "tr", el("th", "Engine"), el("th", "State"), el("th", "Running"), el("th", "Waiting"),
        el("th", "KV cache used"),
    )  # fmt: skip
    rows = [
        el(
            "tr",
            el("td", f"#{i}"),
            el("td", "up" if e.up else "down", data_testid="engine-state"),
            el("td", f"{e.running:,}", data_testid="engine-running"),
            el("td", f"{e.waiting:,}", data_testid="engine-waiting"),
            el("td", f"{percent(e.kv_fraction)} of {e.kv_total:,} blocks", data_testid="engine-kv"),
            data_testid="engine-row",
        )
        for i, e in enumerate(engines)
    ]
    return el("section", el("h2", "Engines"), el("table", head, rows), class_="card")


def tenant_quota_panel(current: LiveFigures) -> Html:
    if not current.tenant_quotas:
        body: Child = el("p", "No tenant has limits.")
    else:
        body = [
            el("div", el("h3", t.name), quota_table(t.lines), data_testid="tenant-quotas")
            for t in current.tenant_quotas
        ]
    title = el("h2", "Quota use across tenants")
    return el("section", title, _unavailable(current), body, class_="card")


def cache_panel(stats: TenantCacheStats) -> Html:
    """The tenant's response cache since this gateway started: how often it answers, how often
    a semantic candidate came close, what the verifier refused and why, and the wrong hits an
    admin reported (each invalidated its entry)."""
    rows = [
        ("Lookups", f"{stats.lookups:,}", "cache-lookups"),
        ("Hit rate", percent(stats.hit_rate), "cache-hit-rate"),
        ("Exact / semantic hits", f"{stats.exact_hits:,} / {stats.semantic_hits:,}", "cache-hits"),
        ("Near misses", f"{stats.near_misses:,} ({percent(stats.near_miss_rate)})", "cache-near"),
        ("Wrong hits reported", f"{stats.wrong_hits:,}", "cache-wrong-hits"),
    ]
    rows += [
        (f"Refused: {reason}", f"{n:,}", f"cache-refused-{reason}")
        for reason, n in sorted(stats.refusals.items())
    ]
    body = [
        el("tr", el("th", label), el("td", value, data_testid=testid))
        for label, value, testid in rows
    ]
    return el("section", el("h2", "Response cache"), el("table", body), class_="card")
