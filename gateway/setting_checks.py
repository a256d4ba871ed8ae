"""Reading and checking `LORAMUX_*` values (gateway.settings): a value not of its type, or out
of its bounds, is refused by its variable's name and the value, where the settings are read, so
that no command starts on it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any


class StartError(Exception):
    """What keeps a `loramux` command from starting, said in one line: the command line prints
    it without a traceback (gateway.cli `main`), since the operator has something to fix in the
    configuration or the host, not a bug to read a stack for."""


class ConfigError(StartError, ValueError):
    """A setting that cannot be used; the message names its LORAMUX_* variable and the value."""


_KINDS = {int: "an integer", float: "a number"}


def env_value(name: str, default: Any, cast: type = str) -> Any:
    """LORAMUX_`name` cast to `cast`, or `default` when unset or empty; ConfigError naming the
    variable and its value when it is not of that type (a bare ValueError named neither)."""
    raw = os.environ.get(f"LORAMUX_{name}")
    if raw is None or raw == "":
        return default
    if cast is bool:
        return _boolean(name, raw)
    try:
        return cast(raw)
    except ValueError:
        kind = _KINDS.get(cast, f"a {cast.__name__}")
        raise ConfigError(f"LORAMUX_{name} must be {kind}, not {raw!r}") from None


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def _boolean(name: str, raw: str) -> bool:
    """A boolean's words, in any case; anything else is refused by name. `enabled` and `ture`
    read as off, silently, when only the true words were looked for."""
    word = raw.strip().lower()
    if word in TRUE_WORDS or word in FALSE_WORDS:
        return word in TRUE_WORDS
    words = f"{', '.join(TRUE_WORDS)} or {', '.join(FALSE_WORDS)}"
    raise ConfigError(f"LORAMUX_{name} must be a boolean ({words}), not {raw!r}")


@dataclass(frozen=True)
class Bound:
    """The values a numeric setting may take, `low` to `high` inclusive (`low` exclusive with
    `above`); NaN and infinity never: a key cache of inf seconds would keep revoked keys
    working for good, and a lease of nan seconds becomes int(nan) in Redis."""

    variable: str
    """The setting's variable without `LORAMUX_`."""
    low: float
    high: float = math.inf
    above: bool = False

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (self.low < value if self.above else self.low <= value) and value <= self.high

    def check(self, value: float | None) -> None:
        """ConfigError naming the variable when `value` (None: unset) is out of bounds."""
        if value is None or self.admits(value):
            return
        if self.above:
            wanted = f"a number above {self.low:g}"
        elif self.high == math.inf:
            wanted = f"at least {self.low:g}"
        else:
            wanted = f"within {self.low:g}..{self.high:g}"
        raise ConfigError(f"LORAMUX_{self.variable} must be {wanted}, not {value!r}")


def check_bounds(settings: object, bounds: dict[str, Bound]) -> None:
    """Check each field of `settings` that `bounds` names against its bound."""
    for name, bound in bounds.items():
        bound.check(getattr(settings, name))
