"""What a database error says about the request that met it, read from the error alone and alike
on SQLite and PostgreSQL, for the one error mapping (`gateway.errors`).

- `unavailable`: the database cannot serve now (a lost or refused connection, a full pool, a
  locked SQLite file, PostgreSQL shutting down or out of connections); a 503 to retry.
- `unstorable_text`: PostgreSQL's text cannot hold NUL (22021); the client's text, a 400.
- `deleted_meanwhile`: a write met a row another request deleted since it was read: an INSERT
  whose foreign key names it (SQLite "FOREIGN KEY constraint failed", PostgreSQL 23503) or an
  UPDATE that matched no row (SQLAlchemy's StaleDataError). Writers of a tenant's rows lock the
  tenant first (`gateway.tenants.lookup.get_locked_tenant`) and answer a 404; this is the net
  for one that does not, a 409 to read again and retry rather than a 500.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import exc as sql
from sqlalchemy.orm.exc import StaleDataError

Fault = Literal["unavailable", "unstorable_text", "deleted_meanwhile"]

UNAVAILABLE_SQLSTATES = ("08", "53", "57")
"""SQLSTATE classes of a database that cannot serve now: connection exception, insufficient
resources (too many connections), operator intervention (shutting down, starting up)."""
NUL_SQLSTATE = "22021"
"""PostgreSQL's `character_not_in_repertoire`: what it answers to text holding NUL."""
FOREIGN_KEY_SQLSTATE = "23503"
"""PostgreSQL's `foreign_key_violation`."""
SQLITE_FOREIGN_KEY = "SQLITE_CONSTRAINT_FOREIGNKEY"
"""SQLite's extended result code for a foreign key constraint failed (Python's sqlite3 names it
on the error since 3.11)."""


def fault_of(exc: Exception) -> Fault | None:
    """The fault `exc` shows, or None when it is no database error this knows."""
    match exc:
        case sql.OperationalError() | sql.InterfaceError() | sql.TimeoutError():
            return "unavailable"
        case sql.DBAPIError() if exc.connection_invalidated:
            return "unavailable"
        case sql.DBAPIError() if _sqlstate(exc)[:2] in UNAVAILABLE_SQLSTATES:
            return "unavailable"
        case sql.DBAPIError() if _sqlstate(exc) == NUL_SQLSTATE:
            return "unstorable_text"
        case sql.IntegrityError() if _foreign_key_violation(exc):
            return "deleted_meanwhile"
        case StaleDataError():
            return "deleted_meanwhile"
    return None


def _sqlstate(exc: sql.DBAPIError) -> str:
    """PostgreSQL's SQLSTATE of the driver's error (asyncpg's, as SQLAlchemy adapts it); ''
    for SQLite's, which has none."""
    sqlstate = getattr(exc.orig, "sqlstate", None)
    return sqlstate if isinstance(sqlstate, str) else ""


def _foreign_key_violation(exc: sql.IntegrityError) -> bool:
    if _sqlstate(exc) == FOREIGN_KEY_SQLSTATE:
        return True
    return getattr(exc.orig, "sqlite_errorname", None) == SQLITE_FOREIGN_KEY
