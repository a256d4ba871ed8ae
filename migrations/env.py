"""Alembic environment: migrations run over the async drivers the gateway itself uses.

The URL comes from `config.attributes["url"]` (set by `gateway.db.migrate`), else from the
gateway's settings (LORAMUX_DATABASE_URL or the default SQLite file) for the `alembic` command.
SQLite cannot alter most of a table in place, so there revisions are rendered and run in batch
mode (copy into a new table, swap). The migration engine is a plain one, without the gateway's
`PRAGMA foreign_keys=ON`: a batch copy drops the old table, and with foreign keys on that drop
would cascade into the rows that reference it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from loramux.gateway.db import Base
from loramux.gateway.db.migrate import sqlite_migration_lock, with_connection
from loramux.gateway.settings import Settings

MIGRATION_LOCK_KEY = 0x6C6D78_6D6967
"""PostgreSQL advisory lock held while migrating: gateways starting together migrate one at a time,
and the ones that wait find the schema at head and do nothing. A SQLite file has a lock file
beside it to the same end (`sqlite_migration_lock`), taken before its version is read."""


def run_migrations(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=sqlite)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("loramux migrations run online only: drop --sql")
url = context.config.attributes.get("url") or Settings().database_url
with sqlite_migration_lock(url):
    with_connection(url, run_migrations)
