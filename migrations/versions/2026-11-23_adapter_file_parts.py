"""Adapter files in the database: `adapter_file_parts`, the shared adapter store that every engine
replica reads (gateway.adapters.shared_store), so no directory has to be shared between machines.

Revision ID: 9b3e5a17c2d0
Revises: 7c2d91e0b5a4
Create Date: 2026-11-23 23:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "9b3e5a17c2d0"
down_revision = "7c2d91e0b5a4"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapter_file_parts",
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("part", sa.Integer(), primary_key=True),
        sa.Column("data", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("adapter_file_parts")
