from __future__ import annotations

from sqlalchemy import Integer
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base, Timestamped

FIRST_START_ROW = 1
"""The only id the first-start table holds."""


class FirstStart(Timestamped, Base):
    """The mark that this database's first start was done (tenant `demo` made, its key shown),
    committed with tenant `demo`: with it, no start makes `demo` again, whatever tenants are
    left (an operator who deleted `demo`, whose key went to the logs, must not get a new one
    printed at every restart). One row at most, its id FIRST_START_ROW."""

    __tablename__ = "first_start"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
