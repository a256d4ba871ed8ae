"""The Alembic revisions build exactly the models' schema, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import DateTime, column, insert, inspect, pool, select, table, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from loramux.gateway.cli import main
from loramux.gateway.db import Base, FirstStart, Tenant
from loramux.gateway.db.first_start import FIRST_START_ROW
from loramux.gateway.db.migrate import alembic_config, current, downgrade, upgrade, with_connection
from loramux.gateway.db.session import async_url
from loramux.gateway.db.usage_rollup import MEASURES
from loramux.gateway.setting_checks import StartError
from loramux.gateway.usage.recorder import _insert_new

REPO = Path(__file__).parents[2]
HEAD = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a database with no tables: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'loramux.db'}"
    return new_postgres_database(request.getfixturevalue("postgres_url"))


def new_postgres_database(server: str, locale: str | None = None) -> str:
    """Create an empty database on the server of `server` (a URL) and return its URL; in
    `locale` (its collation and character classes, e.g. `C.utf8`) rather than the server's C."""
    name = f"migrations_{secrets.token_hex(4)}"
    asyncio.run(create_database(server, name, locale))
    return make_url(server).set(database=name).render_as_string(hide_password=False)


async def create_database(server: str, name: str, locale: str | None = None) -> None:
    engine = create_async_engine(
        async_url(server), isolation_level="AUTOCOMMIT", poolclass=pool.NullPool
    )
    options = (
        f" TEMPLATE template0 ENCODING 'UTF8' LC_COLLATE '{locale}' LC_CTYPE '{locale}'"
        if locale
        else ""
    )
    try:
        async with engine.connect() as connection:
            await connection.execute(text(f'CREATE DATABASE "{name}"{options}'))
    finally:
        await engine.dispose()


def schema_diff(url: str) -> list[object]:
    """What autogenerate would change to make the database match the models; [] when they agree."""
    return with_connection(
        url, lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
    )


def table_names(url: str) -> set[str]:
    return with_connection(url, lambda c: set(inspect(c).get_table_names()))


def add_tenant(connection: Connection, name: str) -> None:
    connection.execute(insert(Tenant).values(id=f"tnt_{name}", name=name))
    connection.commit()


def tenant_names(connection: Connection) -> list[str]:
    return list(connection.scalars(select(Tenant.name)))


def test_the_revisions_form_one_line_of_dated_files() -> None:
    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert len(scripts.get_heads()) == 1
    for script in scripts.walk_revisions():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9_]+\.py", Path(script.path).name)


def test_upgrade_builds_exactly_the_models_schema(empty_database: str) -> None:
    assert current(empty_database) is None
    upgrade(empty_database)
    assert current(empty_database) == HEAD
    assert table_names(empty_database) == {*Base.metadata.tables, "alembic_version"}
    assert schema_diff(empty_database) == []


def test_upgrade_at_head_changes_nothing_and_keeps_the_data(empty_database: str) -> None:
    upgrade(empty_database)
    with_connection(empty_database, lambda c: add_tenant(c, "kept"))
    upgrade(empty_database)
    assert current(empty_database) == HEAD
    assert with_connection(empty_database, tenant_names) == ["kept"]
    assert schema_diff(empty_database) == []


def test_downgrade_to_base_drops_every_table_and_upgrade_rebuilds_them(
    empty_database: str,
) -> None:
    upgrade(empty_database)
    downgrade(empty_database, "base")
    assert current(empty_database) is None
    assert table_names(empty_database) == {"alembic_version"}
    upgrade(empty_database)
    assert schema_diff(empty_database) == []


MIGRATE_AT_GO = """
import sys
from loramux.gateway.db.migrate import upgrade
print("ready", flush=True)
sys.stdin.readline()
upgrade(sys.argv[1])
"""
"""A gateway's migration at its start, once "go" is read: all start at once, Alembic imported."""


def test_gateways_starting_together_migrate_one_at_a_time(empty_database: str) -> None:
    """On SQLite (gateways sharing a volume) they did not take turns, as only PostgreSQL's
    advisory lock existed: all but one failed with "table tenants already exists"."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", MIGRATE_AT_GO, empty_database],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline() == "ready\n"
        for process in processes:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        errors = [process.communicate(timeout=120)[1] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert [p.returncode for p in processes] == [0] * 4, [e[-600:] for e in errors]
    assert current(empty_database) == HEAD
    assert schema_diff(empty_database) == []


def test_upgrade_works_from_any_directory_and_creates_the_sqlite_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'new' / 'data' / 'loramux.db'}"
    upgrade(url)
    assert current(url) == HEAD


def test_loramux_migrate_says_where_it_migrated_without_the_password(
    postgres_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Its one line ("database at ... is up to date") held the URL as given, password and all:
    compose runs it with the PostgreSQL password in the URL, so it went to the container's log."""
    password = "migrate-password-not-logged"
    url = make_url(new_postgres_database(postgres_url)).set(password=password)
    monkeypatch.setenv("LORAMUX_DATABASE_URL", url.render_as_string(hide_password=False))
    monkeypatch.setenv("LORAMUX_DATA_DIR", str(tmp_path / "data"))
    with caplog.at_level(logging.INFO, logger="loramux"):
        main(["migrate"])
    assert current(url.render_as_string(hide_password=False)) == HEAD
    said = caplog.text + "".join(capsys.readouterr())
    assert f"database at {url.render_as_string()} is up to date" in said
    assert password not in said


BEFORE_EVENT_IDS = "908a988c24bb"
"""The revision before usage events had ids of their own (`event_id`)."""


def test_events_stored_before_event_ids_get_unique_ones_and_lose_them_on_downgrade(
    empty_database: str,
) -> None:
    """Each event already stored gets an id no other event has (the column is then unique);
    downgrading drops the column and keeps the events."""
    upgrade(empty_database)
    downgrade(empty_database, BEFORE_EVENT_IDS)
    hour = datetime(2030, 1, 1, 10, tzinfo=UTC)
    with_connection(empty_database, lambda c: _store_refusals(c, [(hour, "k1", None)] * 3))

    upgrade(empty_database)
    assert schema_diff(empty_database) == []
    ids = with_connection(
        empty_database, lambda c: list(c.scalars(text("SELECT event_id FROM usage_events")))
    )
    assert len(set(ids)) == 3 and all(i.startswith("legacy_") for i in ids)

    downgrade(empty_database, BEFORE_EVENT_IDS)
    columns = with_connection(empty_database, lambda c: inspect(c).get_columns("usage_events"))
    assert "event_id" not in {c["name"] for c in columns}
    count = "SELECT count(*) FROM usage_events"
    assert with_connection(empty_database, lambda c: c.scalar(text(count))) == 3


def test_a_gateway_of_the_previous_release_still_stores_its_events_after_the_upgrade(
    empty_database: str,
) -> None:
    """During a rolling upgrade a gateway of the previous release writes events without an
    `event_id` into the migrated database: they are stored (the column stays nullable), and
    the new release's writes still skip the events stored already."""
    upgrade(empty_database)
    hour = datetime(2030, 1, 1, 10, tzinfo=UTC)
    with_connection(empty_database, lambda c: _store_refusals(c, [(hour, "k1", None)] * 2))

    def new_write(connection: Connection) -> list[str]:
        stmt = _insert_new(connection.dialect.name)
        row = {"created_at": hour, "request_id": "req_new", "tenant_id": "tnt_old"}
        row |= {"key_id": "k1", "model": "demo-model", "status": 200, "event_id": "e" * 32}
        stored = [list(connection.scalars(stmt, [row])) for _ in range(2)]
        connection.commit()
        return [i for ids in stored for i in ids]

    assert with_connection(empty_database, new_write) == ["e" * 32]
    ids = "SELECT event_id FROM usage_events ORDER BY id"
    stored = with_connection(empty_database, lambda c: list(c.scalars(text(ids))))
    assert stored == [None, None, "e" * 32]


BEFORE_BACKLOG = "9b3e5a17c2d0"
"""The revision before rollups counted backlog refusals apart from `refused_requests`."""


def test_backlog_refusals_already_rolled_up_move_to_their_own_counter_and_back(
    empty_database: str,
) -> None:
    """Rollup rows written before the revision counted the tokenizer backlog's 429s as
    `refused_requests`; upgrading moves exactly those (counted from the events, per row) to
    `refused_backlog`, leaving rows without any alone; downgrading moves them back."""
    upgrade(empty_database)
    downgrade(empty_database, BEFORE_BACKLOG)
    hour = datetime(2030, 1, 1, 10, tzinfo=UTC)
    later = hour + timedelta(days=1, hours=3)
    # (hour, key, refusal) of each 429: one row with backlog refusals among others, one with
    # only a backlog refusal (another day), one with none.
    refused = [(hour, "k1", "backlog")] * 3 + [(hour, "k1", "requests"), (hour, "k1", None)]
    refused += [(later, "k1", "backlog"), (hour, "k2", "requests")]
    with_connection(empty_database, lambda c: _store_refusals(c, refused))

    upgrade(empty_database)
    counters = with_connection(empty_database, _refusal_counters)
    day, later_day = hour.replace(hour=0), later.replace(hour=0)
    assert counters == {
        ("usage_hourly", hour, "k1"): (2, 3),
        ("usage_hourly", later, "k1"): (0, 1),
        ("usage_hourly", hour, "k2"): (1, 0),
        ("usage_daily", day, "k1"): (2, 3),
        ("usage_daily", later_day, "k1"): (0, 1),
        ("usage_daily", day, "k2"): (1, 0),
    }
    assert schema_diff(empty_database) == []

    downgrade(empty_database, BEFORE_BACKLOG)
    before = with_connection(empty_database, lambda c: _refusal_counters(c, backlog=False))
    assert before == {place: (sum(pair), 0) for place, pair in counters.items()}


def _store_refusals(
    connection: Connection, refused: list[tuple[datetime, str, str | None]]
) -> None:
    """The events and the rollup rows the gateway wrote before the revision."""
    add_tenant(connection, "old")
    events = table(
        "usage_events",
        column("created_at", DateTime(timezone=True)),
        *map(column, ("request_id", "tenant_id", "key_id", "model", "prompt_tokens")),
        *map(column, ("completion_tokens", "cached_tokens", "cache", "status", "latency_ms")),
        column("refusal"),
    )
    rows: Counter[tuple[str, datetime, str]] = Counter()
    for i, (at, key, refusal) in enumerate(refused):
        event = {"created_at": at + timedelta(minutes=i), "request_id": f"req_{i}"}
        event |= {"tenant_id": "tnt_old", "key_id": key, "model": "demo-model", "status": 429}
        event |= {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        event |= {"cache": "miss", "latency_ms": 1.0, "refusal": refusal}
        connection.execute(insert(events).values(event))
        rows[("usage_hourly", at, key)] += 1
        rows[("usage_daily", at.replace(hour=0), key)] += 1
    measures = [m for m in MEASURES if m != "refused_backlog"]
    for (name, bucket, key), n in rows.items():
        keys = map(column, ("tenant_id", "key_id", "model"))
        rollup = table(
            name, column("bucket", DateTime(timezone=True)), *keys, *map(column, measures)
        )
        row = dict.fromkeys(measures, 0) | {"requests": n, "errors": n, "refused_requests": n}
        row |= {"bucket": bucket, "tenant_id": "tnt_old", "key_id": key, "model": "demo-model"}
        connection.execute(insert(rollup).values(row))
    connection.commit()


def _refusal_counters(
    connection: Connection, backlog: bool = True
) -> dict[tuple[str, datetime, str], tuple[int, int]]:
    """(refused_requests, refused_backlog) of each rollup row, by (table, bucket, key)."""
    counters = {}
    for name in ("usage_hourly", "usage_daily"):
        names = ["refused_requests", *(["refused_backlog"] if backlog else [])]
        rollup = table(name, column("bucket", DateTime(timezone=True)), column("key_id"))
        query = select(rollup.c.bucket, rollup.c.key_id, *map(column, names)).select_from(rollup)
        for bucket, key, *values in connection.execute(query):
            at = bucket if bucket.tzinfo else bucket.replace(tzinfo=UTC)
            counters[(name, at, key)] = (values[0], values[1] if backlog else 0)
    return counters


BEFORE_FIRST_START_MARK = "3e8f0c6a1d52"
"""The revision before the first start was marked in the database (table `first_start`)."""


@pytest.mark.parametrize("tenants", [["old"], []])
def test_a_database_with_tenants_is_marked_as_past_its_first_start(
    empty_database: str, tenants: list[str]
) -> None:
    """The first start went by an empty tenants table; now by its mark. A database that holds
    tenants had its first start, so its next start makes no tenant `demo`; one without any has
    not (or lost every tenant), and makes it."""
    upgrade(empty_database)
    downgrade(empty_database, BEFORE_FIRST_START_MARK)
    for name in tenants:
        with_connection(empty_database, lambda c, name=name: add_tenant(c, name))
    upgrade(empty_database)
    marks = with_connection(empty_database, lambda c: list(c.scalars(select(FirstStart.id))))
    assert marks == ([FIRST_START_ROW] if tenants else [])
    assert schema_diff(empty_database) == []


def test_a_database_a_newer_release_migrated_is_refused_in_one_line_and_left_alone(
    empty_database: str,
) -> None:
    """An operator who rolls a release back and runs `loramux migrate` (or serve, which
    migrates at its start) got Alembic's traceback for a revision it cannot locate."""
    upgrade(empty_database)
    newer = "ffffffffffff"
    with_connection(empty_database, lambda c: _stamp(c, newer))
    with pytest.raises(StartError, match=f"revision {newer}, newer than this release"):
        upgrade(empty_database)
    assert current(empty_database) == newer


def _stamp(connection: Connection, revision: str) -> None:
    """Mark the database as at `revision`, as Alembic would."""
    connection.execute(text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    connection.commit()
