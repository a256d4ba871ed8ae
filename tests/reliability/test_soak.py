"""A soak: 2,000 requests of three tenants through one gateway — streamed and whole, base model,
own and shared adapters, repeated deterministic requests (exact cache hits), clients that
disconnect mid-stream or cancel, and bad requests. Afterwards nothing is left held, and usage in
SQL is exactly what the clients received plus what was charged to those that left."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from loramux.gateway.server import RunningServer
from tests.reliability import books
from tests.reliability.rig import admin_client, make_tenants
from tests.reliability.traffic import Mix, Outcome, Tenant, plan_requests, run_load

REQUESTS = int(os.environ.get("LORAMUX_SOAK_REQUESTS", "2000"))
CONCURRENCY = 24
SEED = 20261123


@dataclass(frozen=True)
class Soak:
    tenants: list[Tenant]
    outcomes: list[Outcome]
    residue: books.Residue
    pending_events: int
    rows: list[books.UsageRow]
    ledgers: dict[str, int | None]


@pytest.fixture(scope="module")
async def soak(gateway: RunningServer, redis_url: str, adapter_dirs: list[Path]) -> Soak:
    with admin_client(gateway) as admin:
        tenants = make_tenants(admin, 3, adapter_dirs)
    plans = plan_requests(REQUESTS, len(tenants), Mix(), SEED)
    run = await run_load(gateway.url, tenants, plans, CONCURRENCY)
    residue = await books.settled_residue(gateway, redis_url, tenants)
    return Soak(
        tenants,
        run.outcomes,
        residue,
        await books.pending_usage_events(gateway),
        await books.usage_rows(gateway, tenants),
        {t.id: books.budget_spent(redis_url, t) for t in tenants},
    )


def of(soak: Soak, ending: str) -> Sequence[Outcome]:
    return [o for o in soak.outcomes if o.plan.ending == ending]


def test_the_mix_ends_requests_in_every_way(soak: Soak) -> None:
    completed = of(soak, "complete")
    assert sum(o.cache == "exact" for o in completed) >= 50
    assert {o.plan.stream for o in completed} == {True, False}
    disconnected = of(soak, "disconnect")
    assert {o.content_chunks for o in disconnected} >= {0, 1, 3}
    assert any(o.status is None for o in of(soak, "cancel"))  # cancelled before the answer
    assert len(of(soak, "bad")) >= 10


def test_no_request_gets_a_server_error(soak: Soak) -> None:
    assert books.server_errors(soak.outcomes) == []


def test_every_request_read_to_its_end_gets_a_whole_answer(soak: Soak) -> None:
    assert books.unfinished(soak.outcomes) == []


def test_bad_requests_are_refused_with_a_4xx(soak: Soak) -> None:
    assert books.misrefused(soak.outcomes) == []


def test_the_engine_ends_idle_with_every_kv_block_and_adapter_slot_free(soak: Soak) -> None:
    r = soak.residue
    assert (r.running, r.waiting) == (0, 0)
    assert r.kv_blocks_used == 0
    assert r.pinned_adapter_slots == 0


def test_no_quota_reservation_stays_open(soak: Soak) -> None:
    assert soak.residue.open_reservations == {}


def test_every_usage_event_is_written(soak: Soak) -> None:
    assert soak.pending_events == 0


def test_each_request_has_one_usage_event_billing_what_it_cost(soak: Soak) -> None:
    assert books.billing_errors(soak.outcomes, soak.rows) == []


def test_usage_in_sql_equals_what_clients_received_plus_what_leavers_were_charged(
    soak: Soak,
) -> None:
    totals = books.totals(soak.outcomes, soak.rows)
    assert {t: sql for t, (sql, _) in totals.items()} == {
        t: expected for t, (_, expected) in totals.items()
    }


def test_the_token_budget_ledgers_agree_with_usage_in_sql(soak: Soak) -> None:
    billed = {t.id: sum(r.billed for r in soak.rows if r.tenant_id == t.id) for t in soak.tenants}
    assert soak.ledgers == billed


def test_cache_hits_come_only_from_the_same_tenants_earlier_answers(soak: Soak) -> None:
    assert books.cache_leaks(soak.outcomes) == []
