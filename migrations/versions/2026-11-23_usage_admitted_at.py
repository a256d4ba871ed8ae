"""usage_events.admitted_at: when the request was admitted, so that a token budget counts a
request that ends in the next period in the period that reserved it. Rows written before have
none: they count at `created_at`, as before.

Revision ID: 4f97ac163e4a
Revises: fa68aef8a7b8
Create Date: 2026-11-23 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "4f97ac163e4a"
down_revision = "fa68aef8a7b8"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "usage_events", sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("usage_events") as batch:
        batch.drop_column("admitted_at")
