"""first_start: the mark that a database's first start was done, committed with tenant `demo`.
The first start went by an empty tenants table, so an operator who deleted `demo` (its key had
gone to the logs) got it back, with a new key printed, at every restart.

A database that already holds tenants has had its first start, and is marked so here; one
without any (its first start never ran, or every tenant was deleted) gets one at its next start.

Revision ID: 908a988c24bb
Revises: 3e8f0c6a1d52
Create Date: 2026-11-27 22:00:00
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "908a988c24bb"
down_revision = "3e8f0c6a1d52"
branch_labels = None
depends_on = None


def upgrade() -> None:
    first_start = op.create_table(
        "first_start",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_first_start")),
    )
    tenants = sa.table("tenants", sa.column("id"))
    done = sa.select(sa.literal(1), sa.literal(datetime.now(UTC), sa.DateTime(timezone=True)))
    done = done.where(sa.exists(sa.select(tenants.c.id)))
    op.execute(sa.insert(first_start).from_select(["id", "created_at"], done))


def downgrade() -> None:
    op.drop_table("first_start")
