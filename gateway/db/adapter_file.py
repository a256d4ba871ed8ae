from __future__ import annotations

from sqlalchemy import Integer, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from loramux.gateway.db.base import Base


class AdapterFilePart(Base):
    """One part of one file of a stored adapter, by content digest (gateway.adapters.shared_store).

    An adapter's files are written in one transaction, so they are all there or none is; large
    files are cut into parts so that no value nears a database's size limit per value."""

    __tablename__ = "adapter_file_parts"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
