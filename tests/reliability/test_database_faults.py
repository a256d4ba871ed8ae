"""PostgreSQL stopped under load (its sessions ended at once), then started again.

While the database is gone a request is answered, or refused with a 503 — never a 500, never a
hang; usage of the requests answered meanwhile waits in the recorder and reaches SQL once the
database is back, so nothing already billed is lost; afterwards requests are served again and
nothing stays held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loramux.gateway.server import RunningServer
from tests.postgres import PostgresServer
from tests.reliability import books
from tests.reliability.rig import (
    TenantsDrill,
    admin_client,
    drill,
    gateway_settings,
    make_tenants,
    serve,
    unanswered,
)
from tests.reliability.traffic import Mix, plan_requests

FAULT_MIX = Mix(disconnect=0.0, cancel=0.0, bad=0.0)


@pytest.fixture(scope="module")
def postgres_gateway(
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    postgres_server: PostgresServer,
) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("database-faults-gateway")
    settings = gateway_settings(demo_model_dir, data, database_url=postgres_server.url)
    with serve(settings, redis_url) as server:
        yield server


@pytest.fixture(scope="module")
async def stopped(
    postgres_gateway: RunningServer,
    postgres_server: PostgresServer,
    adapter_dirs: list[Path],
) -> TenantsDrill:
    with admin_client(postgres_gateway) as admin:
        tenants = make_tenants(admin, 2, adapter_dirs)
    try:
        d = await drill(
            postgres_gateway,
            tenants,
            plan_requests(None, len(tenants), FAULT_MIX, seed=31),
            fault=postgres_server.stop,
            outage_seen=unanswered(8),
            recover=postgres_server.start,
        )
    except BaseException:
        postgres_server.start()  # for the tests after this one
        raise
    return TenantsDrill(d, tenants)


def test_the_outage_is_seen_and_service_comes_back(stopped: TenantsDrill) -> None:
    assert stopped.drill.outage_seen
    assert stopped.drill.recovery_seen


def test_requests_are_answered_or_refused_with_a_503_never_a_500(stopped: TenantsDrill) -> None:
    assert books.unclean_failures(stopped.drill.run.outcomes) == []


def test_usage_of_requests_answered_during_the_outage_reaches_sql_afterwards(
    stopped: TenantsDrill, postgres_gateway: RunningServer
) -> None:
    rows = postgres_gateway.run(books.stored_usage(postgres_gateway, stopped.tenants))
    assert books.unbilled(stopped.drill.run.outcomes, rows) == []


async def test_nothing_stays_held(
    stopped: TenantsDrill, postgres_gateway: RunningServer, redis_url: str
) -> None:
    left = await books.settled_residue(postgres_gateway, redis_url, stopped.tenants)
    assert left.idle, left
