"""A small HTML/SVG builder that escapes by construction.

Every `str` placed in a document, as text or as an attribute value, is escaped; only `Html`
values, which this module makes from escaped parts, go in as they are. Tag and attribute names
are code, never data, and are checked to be plain names.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable

_NAME = re.compile(r"[a-zA-Z][a-zA-Z0-9-]*")
_VOID = frozenset({"br", "input", "meta", "link", "hr", "img"})


class Html(str):
    """Markup that is already safe to place as it is."""


Child = Html | str | int | float | None | Iterable["Child"]
AttrValue = str | int | float | bool | None


def render(child: Child) -> Html:
    """`child` as markup: text escaped, numbers written out, None and False left out."""
    if isinstance(child, Html):
        return child
    if isinstance(child, str):
        return Html(html.escape(child, quote=True))
    if child is None or isinstance(child, bool):
        return Html("")
    if isinstance(child, int | float):
        return Html(_number(child))
    return Html("".join(render(c) for c in child))


def el(tag: str, *children: Child, **attrs: AttrValue) -> Html:
    """`<tag attrs>children</tag>`. Attribute names are keyword names with `_` written as `-`
    and a trailing `_` dropped (`class_`, `data_testid`); None and False leave one out, True
    writes it bare."""
    assert _NAME.fullmatch(tag), tag
    parts = [tag]
    for key, value in attrs.items():
        name = key.rstrip("_").replace("_", "-")
        assert _NAME.fullmatch(name), name
        if value is True:
            parts.append(name)
        elif value is not None and value is not False:
            parts.append(f'{name}="{render(value if isinstance(value, str) else _number(value))}"')
    opening = f"<{' '.join(parts)}>"
    if tag in _VOID:
        return Html(opening)
    return Html(f"{opening}{render(children)}</{tag}>")


def _number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"
