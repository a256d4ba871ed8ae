"""usage_events.event_id: an id given to each event when it is recorded, unique, so a write
tried again after its commit's reply was lost (committed, but taken as failed) stores and rolls
up nothing twice (gateway.usage.recorder inserts ON CONFLICT DO NOTHING).

The events already stored get `legacy_<id>` (unique, and never an id the gateway gives: those
are 32 hex digits) before its unique index is built.

The column stays nullable: during a rolling upgrade a gateway of the previous release still
writes events without an id into the migrated database, and a NOT NULL would refuse them (its
recorder takes an integrity error as the events' fault and drops them for good). Their NULLs
are distinct in the unique index, so they insert, and the new release's ON CONFLICT (event_id)
still skips its own events stored already. A later release may make the column NOT NULL (after
filling the NULLs) once no gateway of this one's predecessor writes.

Revision IDRevision ID: 7c2d4e9a0b61
Revises: 908a988c24bb
Create Date: 2026-11-28 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "7c2d4e9a0b61"
down_revision = "908a988c24bb"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("usage_events", sa.Column("event_id", sa.String(length=32), nullable=True))
    events = sa.table("usage_events", sa.column("id"), sa.column("event_id"))
    legacy = sa.literal("legacy_") + sa.cast(events.c.id, sa.String())
    op.execute(sa.update(events).values(event_id=legacy))
    op.create_index(op.f("ix_usage_events_event_id"), "usage_events", ["event_id"], unique=True)


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_events_event_id"), table_name="usage_events")
    with op.batch_alter_table("usage_events") as batch:
        batch.drop_column("event_id")
