"""Usage outcomes: `usage_events.refusal` (the limit behind a 429) and, in both rollups, one
counter per outcome of a request that did not succeed: aborts (499), refusals by limit (429),
other client errors (4xx) and server errors (5xx).

The new counters are filled from the events already stored (one UPDATE … FROM per rollup), so
history reads the same as new usage. Events written before have no `refusal`: their 429s count
as `refused_requests`, as the gateway counts a 429 with no known limit. The time truncation is
copied from the rollups revision on purpose: a revision describes the schema as it was.

Revision ID: 7c2d91e0b5a4
Revises: 4f97ac163e4a
Create Date: 2026-11-23 20:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "7c2d91e0b5a4"
down_revision = "4f97ac163e4a"
branch_labels = None
depends_on = None

OUTCOMES = (
    "aborts",
    "refused_requests",
    "refused_tokens",
    "refused_concurrency",
    "refused_budget",
    "client_errors",
    "server_errors",
)
ROLLUPS = {"usage_hourly": "hour", "usage_daily": "day"}
GROUP = ("tenant_id", "key_id", "model")


def upgrade() -> None:
    op.add_column("usage_events", sa.Column("refusal", sa.String(length=16), nullable=True))
    for table, unit in ROLLUPS.items():
        for name in OUTCOMES:
            column = sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            op.add_column(table, column)
        _backfill(table, unit)


def downgrade() -> None:
    for table in ("usage_events", *ROLLUPS):
        with op.batch_alter_table(table) as batch:
            for name in OUTCOMES if table in ROLLUPS else ("refusal",):
                batch.drop_column(name)


def _backfill(table: str, unit: str) -> None:
    events = sa.table(
        "usage_events", *(sa.column(c) for c in ("created_at", *GROUP, "status", "refusal"))
    )
    c = events.c

    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[Any]:
        return sa.func.sum(sa.case((condition, 1), else_=0))

    refused = {
        "refused_tokens": c.refusal == "tokens",
        "refused_concurrency": c.refusal == "concurrency",
        "refused_budget": c.refusal == "budget",
    }
    others = ("tokens", "concurrency", "budget")
    refused["refused_requests"] = c.refusal.is_(None) | c.refusal.not_in(others)
    sums = {
        "aborts": count(c.status == 499),
        **{name: count((c.status == 429) & condition) for name, condition in refused.items()},
        "client_errors": count((c.status >= 400) & (c.status < 500) & c.status.not_in((429, 499))),
        "server_errors": count(c.status >= 500),
    }
    bucket = _truncate(c.created_at, unit).label("bucket")
    groups = (
        sa.select(bucket, *(c[g] for g in GROUP), *(s.label(n) for n, s in sums.items()))
        .where(c.status >= 400)
        .group_by(bucket, *(c[g] for g in GROUP))
        .subquery()
    )
    rollup = sa.table(
        table, sa.column("bucket"), *(sa.column(g) for g in GROUP), *map(sa.column, OUTCOMES)
    )
    same_row = [rollup.c[g] == groups.c[g] for g in GROUP]
    same_row.append(rollup.c.bucket == groups.c.bucket)
    op.execute(sa.update(rollup).where(*same_row).values({n: groups.c[n] for n in OUTCOMES}))


def _truncate(created_at: sa.ColumnElement[Any], unit: str) -> sa.ColumnElement[Any]:
    """The UTC start of the hour or day, stored the way the gateway stores times."""
    if op.get_bind().dialect.name == "sqlite":
        # SQLAlchemy keeps SQLite times as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC).
        pattern = "%Y-%m-%d %H:00:00.000000" if unit == "hour" else "%Y-%m-%d 00:00:00.000000"
        return sa.func.strftime(pattern, created_at)
    utc_wall = sa.func.timezone("UTC", created_at)
    return sa.func.timezone("UTC", sa.func.date_trunc(unit, utc_wall))
