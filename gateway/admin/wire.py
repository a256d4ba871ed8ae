"""Wire pieces every admin domain shares: the name rule, "fields a body named", timestamps.

Admin request bodies are msgspec structs that Litestar decodes from `data:`. Unknown fields are
refused, so a typo (`"rmp": 10`) is a 400, not a silent no-op. Fields that may be left out of a
PATCH-like body are `UNSET` when absent, which keeps "absent" (leave as it is) apart from `null`
(remove).
"""

from __future__ import annotations

import unicodedata
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, Struct

from loramux.gateway.errors import BadRequest

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

DisplayName = Annotated[str, Meta(min_length=1, max_length=200)]
"""A name people read (tenants, keys); also held to `check_display_name`."""
ModelName = Annotated[str, Meta(min_length=1, max_length=200)]


class Deleted(Struct):
    """What a DELETE removed."""

    id: str
    deleted: bool = True
    detail: dict[str, int] = msgspec.field(default_factory=dict)
    note: str | None = None
    """What the DELETE, which took effect, could not finish yet (and retries by itself)."""


_HIDDEN_CHARACTERS = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Zs"})
"""Unicode categories that hide or disguise text: controls (NUL, escape), format characters
(bidirectional overrides, zero-width joiners), lone surrogates, line and paragraph separators,
and every space but U+0020 (a no-break or ideographic space reads as a space, so `acme corp`
and `acme\u00a0corp` would be two names that look the same)."""

# Default_Ignorable_Code_Point, from Unicode 14.0's DerivedCoreProperties.txt (adjacent ranges
# merged): what a renderer shows as nothing. Besides format characters it holds marks and
# letters no category gives away: the combining grapheme joiner, variation selectors, the
# Hangul fillers. Python's unicodedata has no such property.
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)


def _is_hidden(char: str) -> bool:
    """Whether `char` hides or disguises text: of `_HIDDEN_CHARACTERS` (but ' '), or ignorable."""
    if char == " ":
        return False
    code = ord(char)
    return unicodedata.category(char) in _HIDDEN_CHARACTERS or any(
        first <= code <= last for first, last in _DEFAULT_IGNORABLE
    )


def check_display_name(value: str, field: str) -> None:
    """Refuse a name people read (in listings, the dashboard, logs) that could disguise itself:
    leading or trailing whitespace, a character `_is_hidden`, or text not in Unicode's NFC (a
    decomposed `e` + U+0301 reads as the composed `é` of another name)."""
    if value != value.strip():
        raise BadRequest(
            f"{field} may not start or end with whitespace", param=field, code="invalid_request"
        )
    for position, char in enumerate(value):
        if _is_hidden(char):
            raise BadRequest(
                f"{field} may not hold control, format, invisible or space characters other "
                f"than ' ' (U+{ord(char):04X} at position {position})",
                param=field,
                code="invalid_request",
            )
    if not unicodedata.is_normalized("NFC", value):
        raise BadRequest(
            f"{field} must be in Unicode normal form NFC (composed: 'é' as U+00E9, not 'e' "
            "followed by U+0301)",
            param=field,
            code="invalid_request",
        )


def given(body: Struct) -> dict[str, Any]:
    """The fields a body named (null included); fields left out are not there."""
    return {f: v for f in body.__struct_fields__ if (v := getattr(body, f)) is not UNSET}


def utc(ts: datetime) -> datetime:
    """Timestamps as UTC; SQLite returns them naive (they were stored as UTC)."""
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts.astimezone(UTC)


def utc_input(ts: datetime, param: str) -> datetime:
    """A time a request gave, as UTC; refused (400) when UTC cannot express it: an offset
    carries it past 9999-12-31 or before 0001-01-01."""
    try:
        return utc(ts)
    except OverflowError:
        raise BadRequest(
            f"{param} is out of range: times run from 0001-01-01 to 9999-12-31 (UTC)",
            param=param,
            code="invalid_request",
        ) from None


def utc_or_none(ts: datetime | None) -> datetime | None:
    return utc(ts) if ts is not None else None
