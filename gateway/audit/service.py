"""The audit log: one row per admin action, written whether the action succeeded or not.

An entry is written in its own transaction, after the action's own transaction has ended, so a
failed action (rolled back) still leaves its entry, and a failure to write the entry never turns
a finished action into an error (it is logged instead). Wrap each action in `audited(...)`:

    async with audit_log.audited(actor, "tenant.create") as entry:
        tenant = await tenants.create(body)
        entry.target = tenant.id

Admin routes do not call this themselves: they name their action (`gateway.audit.action`) and
take the `entry` dependency, which wraps the whole request, body decoding included.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.admin.paging import Paging, page_of
from loramux.gateway.db import AuditEntry
from loramux.gateway.errors import NUL, to_gateway_error
from loramux.gateway.logged_text import loggable

log = logging.getLogger(__name__)

OK = "ok"
FAILURE_LOG_INTERVAL = 10.0
"""At most one line per this many seconds says that entries could not be written: while the
database refuses writes, a stranger's every request with a bad admin token makes one fail."""


@dataclass
class AuditRecord:
    """What the action says about itself while it runs: its target and a small detail object."""

    target: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class AuditLog:
    """The audit log, written in transactions of its own (see the module docstring)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions
        self._failure_logged = -math.inf
        self._failures_unlogged = 0

    @asynccontextmanager
    async def audited(
        self, actor: str, action: str, target: str | None = None
    ) -> AsyncIterator[AuditRecord]:
        """Run an admin action and write its audit entry: outcome `ok`, or the error's code.

        `actor` is the admin token's subject (or a name such as `first-start` for actions taken
        outside a request). The exception (if any) propagates unchanged after the entry is
        written."""
        record = AuditRecord(target)
        try:
            yield record
        except Exception as exc:
            await self.finish(actor, action, record, exc)
            raise
        await self.finish(actor, action, record, None)

    async def finish(
        self, actor: str, action: str, record: AuditRecord, exc: Exception | None
    ) -> None:
        """Write the entry of an action that ended: outcome `ok`, or the code of `exc`."""
        if exc is None:
            await self.write(actor, action, record.target, OK, record.detail)
            return
        err = to_gateway_error(exc)
        outcome = (err.code or f"http_{err.status}") if err is not None else "internal_error"
        message = err.message if err is not None else type(exc).__name__
        detail = record.detail | {"error": message[:500]}
        await self.write(actor, action, record.target, outcome, detail)

    async def write(
        self, actor: str, action: str, target: str | None, outcome: str, detail: dict[str, Any]
    ) -> None:
        """Append one entry; values longer than their columns are cut (the full code stays in
        `detail`), and NUL is written `\\x00`, so whatever a request's path or token held, its
        entry can be stored. Never raises: a broken audit log is logged, not reported to the
        caller."""
        if len(outcome) > _OUTCOME_LENGTH:
            detail = detail | {"code": outcome}
        entry = AuditEntry(
            actor=_storable(actor, _ACTOR_LENGTH),
            action=action,
            target=_storable(target, _TARGET_LENGTH) if target is not None else None,
            outcome=_storable(outcome, _OUTCOME_LENGTH),
            detail=detail,
        )
        try:
            async with self._sessions() as session, session.begin():
                session.add(entry)
        except Exception:
            self._log_failure(action, target)

    def _log_failure(self, action: str, target: str | None) -> None:
        """Log the entry that could not be written, with its error, unless a line did less than
        FAILURE_LOG_INTERVAL ago; the next line counts those left out. Call it while handling
        the error."""
        now = time.monotonic()
        if now - self._failure_logged < FAILURE_LOG_INTERVAL:
            self._failures_unlogged += 1
            return
        unlogged, self._failures_unlogged, self._failure_logged = self._failures_unlogged, 0, now
        log.exception(
            "could not write the audit entry for %s on %s (and %d more not logged since the "
            "last such line)",
            action,
            loggable(target) if target is not None else "no target",
            unlogged,
        )

    async def recent(self, paging: Paging) -> tuple[list[AuditEntry], int]:
        """A page of entries, newest first, and how many the filter matches; `paging.name`
        keeps entries whose target holds it."""
        query = select(AuditEntry).order_by(AuditEntry.id.desc())
        if (matches := paging.name_filter(AuditEntry.target)) is not None:
            query = query.where(matches)
        async with self._sessions() as session:
            rows, total = await page_of(session, query, paging)
        return list(rows), total


def _storable(text: str, length: int) -> str:
    """`text` as a column of `length` characters holds it on every database: PostgreSQL's text
    cannot hold NUL (an entry holding one was lost), so it is written as `\\x00`."""
    return text.replace(NUL, "\\x00")[:length]


def _column_length(name: str) -> int:
    length = getattr(AuditEntry.__table__.c[name].type, "length", None)
    assert isinstance(length, int), f"audit_log.{name} must be a bounded string column"
    return length


_ACTOR_LENGTH = _column_length("actor")
_TARGET_LENGTH = _column_length("target")
_OUTCOME_LENGTH = _column_length("outcome")
