"""Usage outcomes: `refused_backlog` in both rollups, the 429s a tenant gets while its bound of
prompts is already waiting for the gateway's tokenizer threads (`usage_events.refusal` =
'backlog'). They were counted as `refused_requests`, which the dashboard shows as requests per
minute: a tenant was told it hit a limit it had not.

The counts move from `refused_requests` to the new column for the events already stored (one
UPDATE … FROM per rollup), so history reads the same as new usage; downgrade moves them back. The
time truncation is copied from the rollups revision on purpose: a revision describes the schema
as it was.

Revision ID: 3e8f0c6a1d52
Revises: 9b3e5a17c2d0
Create Date: 2026-11-27 08:00:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "3e8f0c6a1d52"
down_revision = "9b3e5a17c2d0"
branch_labels = None
depends_on = None

ROLLUPS = {"usage_hourly": "hour", "usage_daily": "day"}
GROUP = ("tenant_id", "key_id", "model")


def upgrade() -> None:
    for table, unit in ROLLUPS.items():
        column = sa.Column("refused_backlog", sa.BigInteger(), nullable=False, server_default="0")
        op.add_column(table, column)
        _move_backlog_refusals(table, unit)


def downgrade() -> None:
    for table in ROLLUPS:
        rollup = _rollup(table)
        back = {"refused_requests": rollup.c.refused_requests + rollup.c.refused_backlog}
        op.execute(sa.update(rollup).values(back))
        with op.batch_alter_table(table) as batch:
            batch.drop_column("refused_backlog")


def _move_backlog_refusals(table: str, unit: str) -> None:
    """Each rollup row's backlog 429s, counted from the events, move out of `refused_requests`."""
    events = sa.table(
        "usage_events", *(sa.column(c) for c in ("created_at", *GROUP, "status", "refusal"))
    )
    c = events.c
    bucket = _truncate(c.created_at, unit).label("bucket")
    groups = (
        sa.select(bucket, *(c[g] for g in GROUP), sa.func.count().label("n"))
        .where(c.status == 429, c.refusal == "backlog")
        .group_by(bucket, *(c[g] for g in GROUP))
        .subquery()
    )
    rollup = _rollup(table)
    same_row = [rollup.c[g] == groups.c[g] for g in GROUP]
    same_row.append(rollup.c.bucket == groups.c.bucket)
    moved = {
        "refused_backlog": groups.c.n,
        "refused_requests": rollup.c.refused_requests - groups.c.n,
    }
    op.execute(sa.update(rollup).where(*same_row).values(moved))


def _rollup(table: str) -> sa.TableClause:
    columns = ("bucket", *GROUP, "refused_requests", "refused_backlog")
    return sa.table(table, *map(sa.column, columns))


def _truncate(created_at: sa.ColumnElement[Any], unit: str) -> sa.ColumnElement[Any]:
    """The UTC start of the hour or day, stored the way the gateway stores times."""
    if op.get_bind().dialect.name == "sqlite":
        # SQLAlchemy keeps SQLite times as 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC).
        pattern = "%Y-%m-%d %H:00:00.000000" if unit == "hour" else "%Y-%m-%d 00:00:00.000000"
        return sa.func.strftime(pattern, created_at)
    utc_wall = sa.func.timezone("UTC", created_at)
    return sa.func.timezone("UTC", sa.func.date_trunc(unit, utc_wall))
