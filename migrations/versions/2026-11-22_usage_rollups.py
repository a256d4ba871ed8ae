"""Hourly and daily usage rollups (built from the events already stored); one tenant-level quota
row per tenant.

The rollups are filled from `usage_events` by one INSERT … SELECT per table, so a database that
already holds events reports the same usage after the upgrade as before. The histogram edges are
copied here on purpose: a revision describes the schema as it was when written.

`quotas` had UNIQUE (tenant_id, key_id), which never fires for the tenant-level row (key_id NULL,
and NULLs are distinct). A partial unique index now covers it; duplicates left by concurrent
writes are removed first, keeping the row with the smallest id.

Revision ID: fa68aef8a7b8
Revises: 161bc3649f82
Create Date: 2026-11-22 12:57:43
"""

from __future__ import annotations

import itertools
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "fa68aef8a7b8"
down_revision = "161bc3649f82"
branch_labels = None
depends_on = None

BOUNDS_MS = (
    5,
    10,
    20,
    50,
    100,
    200,
    350,
    500,
    750,
    1000,
    1500,
    2000,
    3000,
    5000,
    10000,
    20000,
    60000,
)
BINS = len(BOUNDS_MS) + 1
COUNTERS: tuple[str, ...] = ("requests", "errors", "prompt_tokens", "completion_tokens")
COUNTERS += ("cached_tokens", "exact_hits", "semantic_hits", "ttft_count")
SUMS = ("latency_ms_sum", "ttft_ms_sum")
HISTOGRAMS = ("latency", "ttft")
TENANT_LEVEL = sa.text("key_id IS NULL")


def upgrade() -> None:
    for grain in ("hourly", "daily"):
        table = f"usage_{grain}"
        key = sa.PrimaryKeyConstraint("tenant_id", "bucket", "key_id", "model", name=f"pk_{table}")
        op.create_table(table, *_rollup_columns(), key)
        op.create_index(f"ix_{table}_bucket", table, ["bucket"])
        _backfill(table, "hour" if grain == "hourly" else "day")
    quotas = sa.table("quotas", sa.column("id"), sa.column("tenant_id"), sa.column("key_id"))
    keep = sa.select(sa.func.min(quotas.c.id)).where(TENANT_LEVEL).group_by(quotas.c.tenant_id)
    op.execute(quotas.delete().where(TENANT_LEVEL, quotas.c.id.not_in(keep)))
    op.create_index(
        "uq_quotas_tenant_level",
        "quotas",
        ["tenant_id"],
        unique=True,
        sqlite_where=TENANT_LEVEL,
        postgresql_where=TENANT_LEVEL,
    )


def downgrade() -> None:
    op.drop_index("uq_quotas_tenant_level", "quotas")
    for table in ("usage_daily", "usage_hourly"):
        op.drop_table(table)


def _bins(name: str) -> list[str]:
    return [f"{name}_bin{i:02d}" for i in range(BINS)]


def _rollup_columns() -> list[sa.Column[Any]]:
    integers = [*COUNTERS, *_bins("latency"), *_bins("ttft")]
    return [
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in COUNTERS),
        *(sa.Column(c, sa.Float(), nullable=False) for c in SUMS),
        *(sa.Column(c, sa.BigInteger(), nullable=False) for c in integers[len(COUNTERS) :]),
    ]


def _backfill(table: str, unit: str) -> None:
    events = sa.table(
        "usage_events",
        *(sa.column(c) for c in ("created_at", "tenant_id", "key_id", "model", "prompt_tokens")),
        *(sa.column(c) for c in ("completion_tokens", "cached_tokens", "cache", "status")),
        sa.column("latency_ms"),
        sa.column("ttft_ms"),
    )
    c = events.c
    bucket = _truncate(c.created_at, unit).label("bucket")

    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.sum(sa.case((condition, 1), else_=0))

    measures: list[sa.ColumnElement[Any]] = [
        sa.func.count(),
        count(c.status >= 400),
        sa.func.sum(c.prompt_tokens),
        sa.func.sum(c.completion_tokens),
        sa.func.sum(c.cached_tokens),
        count(c.cache == "exact"),
        count(c.cache == "semantic"),
        count(c.ttft_ms.is_not(None)),
        sa.func.sum(c.latency_ms),
        sa.func.coalesce(sa.func.sum(c.ttft_ms), 0.0),
    ]
    for column in (c.latency_ms, c.ttft_ms):
        edges = [None, *BOUNDS_MS, None]
        for low, high in itertools.pairwise(edges):
            in_bin = sa.and_(
                column.is_not(None),
                column > low if low is not None else sa.true(),
                column <= high if high is not None else sa.true(),
            )
            measures.append(count(in_bin))
    groups = [bucket, c.tenant_id, c.key_id, c.model]
    names = ["bucket", "tenant_id", "key_id", "model", *COUNTERS, *SUMS]
    names += [*_bins("latency"), *_bins("ttft")]
    select = sa.select(*groups, *measures).group_by(*groups)
    target = sa.table(table, *(sa.column(n) for n in names))
    op.execute(target.insert().from_select(names, select))


def _truncate(created_at: sa.ColumnElement[Any], unit: str) -> sa.ColumnElement[Any]:
    """The UTC start of the hour or day, stored the way the gateway stores times."""
    if op.get_bind().dialect.name == "sqlite":
        # SQLAlchemy keeps SQLite times as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC).
        pattern = "%Y-%m-%d %H:00:00.000000" if unit == "hour" else "%Y-%m-%d 00:00:00.000000"
        return sa.func.strftime(pattern, created_at)
    utc_wall = sa.func.timezone("UTC", created_at)
    return sa.func.timezone("UTC", sa.func.date_trunc(unit, utc_wall))
