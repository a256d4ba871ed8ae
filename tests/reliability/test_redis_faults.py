"""Redis paused (SIGSTOP, then SIGCONT) or killed (SIGKILL, then started empty) under load.

As README documents it, with LORAMUX_QUOTA_ON_REDIS_DOWN=reject (the default): while Redis is
gone a tenant with limits gets 503 `quota_unavailable`, a tenant without limits is served
(uncached), nothing hangs, and no other error is answered. Nothing already billed is lost. Once
Redis is back, requests are served again, no refused request holds a reservation, and after a
restart the budget ledger is rebuilt from the usage in SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loramux.gateway.server import RunningServer
from loramux.gateway.settings import QuotaSettings
from tests.redis import RedisServer, running_redis
from tests.reliability import books
from tests.reliability.rig import (
    Drill,
    admin_client,
    answered,
    drill,
    gateway_settings,
    make_tenants,
    serve,
)
from tests.reliability.traffic import Mix, Outcome, Tenant, plan_requests

FAULT_MIX = Mix(disconnect=0.0, cancel=0.0, bad=0.0)
LEASE_SECONDS = 3.0
"""A short slot lease, so a slot a lost settlement left behind expires within the test."""


@pytest.fixture(scope="module")
def redis_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this module's own, to pause and kill."""
    with running_redis(tmp_path_factory.mktemp("redis-faults")) as server:
        yield server


@pytest.fixture(scope="module")
def gateway_on_it(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_alone: RedisServer
) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("redis-faults-gateway")
    quotas = QuotaSettings(on_redis_down="reject", slot_lease_seconds=LEASE_SECONDS)
    with serve(gateway_settings(demo_model_dir, data, quotas=quotas), redis_alone.url) as server:
        yield server


@dataclass(frozen=True)
class RedisDrill:
    drill: Drill
    limited: Tenant
    unlimited: Tenant
    billed_before_restart: int
    """The limited tenant's tokens in SQL when Redis came back (restart drill only)."""


def tenants(gateway: RunningServer, adapter_dirs: list[Path]) -> tuple[Tenant, Tenant]:
    with admin_client(gateway) as admin:
        [limited] = make_tenants(admin, 1, adapter_dirs)
        [unlimited] = make_tenants(admin, 1, adapter_dirs[2:], quotas=None)
    return limited, unlimited


def refused_and_served(
    limited: Tenant, unlimited: Tenant, each: int = 8
) -> Callable[[list[Outcome]], bool]:
    """The outage has shown for a while: `each` requests of the limited tenant refused and of
    the unlimited one served, since the fault."""

    def seen(outcomes: list[Outcome]) -> bool:
        refused = sum(o.tenant_id == limited.id and o.status == 503 for o in outcomes)
        served = sum(o.tenant_id == unlimited.id and answered(o) for o in outcomes)
        return refused >= each and served >= each

    return seen


@pytest.fixture(scope="module")
async def paused(
    gateway_on_it: RunningServer, redis_alone: RedisServer, adapter_dirs: list[Path]
) -> RedisDrill:
    limited, unlimited = tenants(gateway_on_it, adapter_dirs)
    d = await drill(
        gateway_on_it,
        [limited, unlimited],
        plan_requests(None, 2, FAULT_MIX, seed=11),
        fault=redis_alone.pause,
        outage_seen=refused_and_served(limited, unlimited),
        recover=redis_alone.resume,
    )
    return RedisDrill(d, limited, unlimited, 0)


@pytest.fixture(scope="module")
async def restarted(
    gateway_on_it: RunningServer, redis_alone: RedisServer, adapter_dirs: list[Path]
) -> RedisDrill:
    limited, unlimited = tenants(gateway_on_it, adapter_dirs)
    billed: list[int] = []

    def restart() -> None:
        rows = gateway_on_it.run(books.stored_usage(gateway_on_it, [limited]))
        billed.append(sum(r.billed for r in rows))
        redis_alone.start()

    d = await drill(
        gateway_on_it,
        [limited, unlimited],
        plan_requests(None, 2, FAULT_MIX, seed=12),
        fault=redis_alone.kill,
        outage_seen=refused_and_served(limited, unlimited),
        recover=restart,
    )
    return RedisDrill(d, limited, unlimited, billed[0])


DRILLS = ["paused", "restarted"]


@pytest.fixture(params=DRILLS)
def redis_drill(request: pytest.FixtureRequest) -> RedisDrill:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


def test_the_outage_is_seen_and_service_comes_back(redis_drill: RedisDrill) -> None:
    assert redis_drill.drill.outage_seen
    assert redis_drill.drill.recovery_seen


def test_limited_requests_fail_only_with_503_quota_unavailable(redis_drill: RedisDrill) -> None:
    outcomes = redis_drill.drill.run.outcomes
    assert books.unclean_failures(outcomes, {"quota_unavailable"}) == []


def test_requests_of_a_tenant_without_limits_are_all_served(redis_drill: RedisDrill) -> None:
    mine = [o for o in redis_drill.drill.run.outcomes if o.tenant_id == redis_drill.unlimited.id]
    assert [o.plan.index for o in mine if not answered(o)] == []


def test_every_answered_request_is_billed_once(
    redis_drill: RedisDrill, gateway_on_it: RunningServer
) -> None:
    d = redis_drill
    rows = gateway_on_it.run(books.stored_usage(gateway_on_it, [d.limited, d.unlimited]))
    assert books.unbilled(d.drill.run.outcomes, rows) == []


async def test_no_reservation_outlives_the_outage(
    redis_drill: RedisDrill, gateway_on_it: RunningServer, redis_alone: RedisServer
) -> None:
    """Slots left by settlements Redis never saw expire with their lease; a request refused
    with 503 reserves nothing anywhere, and every admitted one is settled once."""
    d = redis_drill
    left = await books.settled_residue(
        gateway_on_it, redis_alone.url, [d.limited, d.unlimited], seconds=3 * LEASE_SECONDS
    )
    assert left.open_reservations == {}


def test_after_a_restart_the_budget_ledger_starts_from_the_usage_in_sql(
    restarted: RedisDrill, redis_alone: RedisServer
) -> None:
    spent = books.budget_spent(redis_alone.url, restarted.limited)
    assert spent is not None and spent >= restarted.billed_before_restart > 0
