"""Pages of admin lists: `?limit=&offset=` (limit 1-500, 50 when absent) and `?name=` (a
part of the name, in any case as far as the database's lower() folds it: see
`Paging.name_filter`), answered as `{"items", "total", "limit", "offset"}`.

`total` counts every row the filter matches, so a client walks `offset` from 0 in steps of
`limit` until `offset >= total`. Each list orders by a unique key (creation time, then id), so
the walk sees each row exactly once while nothing is added or removed under it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from litestar.params import QueryParameter
from sqlalchemy import ColumnElement, Select, String, func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_OFFSET = 2**31 - 1

Row = TypeVar("Row")


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int
    name: str | None
    """Rows whose name holds this text (in any case, as the database folds it); None: every
    row."""

    def name_filter(self, column: Any) -> ColumnElement[bool] | None:
        """Rows whose `column` holds the name: `lower(column) LIKE '%' || lower(:name) || '%'`.
        Both sides are folded by the same SQL lower(), so a name always finds itself; which
        letters fold is the database's: ASCII only on SQLite and in PostgreSQL's C locale, all
        of Unicode in its UTF-8 locales. (Folding the needle in Python instead disagreed with
        such a locale: `ΟΔΟΣ` and `İzmir` did not find themselves.)"""
        if self.name is None:
            return None
        escaped = "".join(f"{_ESCAPE}{c}" if c in _LIKE_SPECIAL else c for c in self.name)
        needle = func.lower(literal(escaped, String))
        return func.lower(column).contains(needle, escape=_ESCAPE)


_ESCAPE = "/"
_LIKE_SPECIAL = frozenset(("%", "_", _ESCAPE))


async def provide_paging(
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    offset: Annotated[int, QueryParameter(ge=0, le=MAX_OFFSET)] = 0,
    name: Annotated[str | None, QueryParameter(min_length=1, max_length=200)] = None,
) -> Paging:
    """The `paging` dependency of every paginated admin list."""
    return Paging(limit, offset, name)


async def page_of(
    session: AsyncSession, query: Select[Row], paging: Paging
) -> tuple[Sequence[Row], int]:
    """One page of `query` (already filtered and ordered) and the count of all its rows."""
    total = await session.scalar(select(func.count()).select_from(query.order_by(None).subquery()))
    rows = await session.scalars(query.limit(paging.limit).offset(paging.offset))
    return list(rows), total or 0
