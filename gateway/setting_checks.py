"""Reading and checking `LORAMUX_*` values (gateway.settings): a value not of its type, or out
of its bounds, is refused by its variable's name and the value, where the settings are read, so
that no command starts on it. Each settings class has a table here of its fields' bounds."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from loramux.engine.config import MAX_CPU_THREADS


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
            wanted = f"a number above {_number(self.low)}"
        elif self.high == math.inf:
            wanted = f"at least {_number(self.low)}"
        else:
            wanted = f"within {_number(self.low)}..{_number(self.high)}"
        raise ConfigError(f"LORAMUX_{self.variable} must be {wanted}, not {value!r}")


def _number(bound: float) -> str:
    """A bound as written: 31622400, not %g's 3.16224e+07; 0.1 as 0.1."""
    return str(int(bound)) if bound == int(bound) else f"{bound:g}"


def check_bounds(settings: object, bounds: dict[str, Bound]) -> None:
    """Check each field of `settings` that `bounds` names against its bound."""
    for name, bound in bounds.items():
        bound.check(getattr(settings, name))


ENGINE_BOUNDS = {
    "kv_cache_mb": Bound("KV_CACHE_MB", 1),
    "max_num_seqs": Bound("MAX_NUM_SEQS", 1),
    "max_waiting": Bound("MAX_WAITING", 0),  # 0: only what runs is taken
    "max_num_batched_tokens": Bound("MAX_BATCHED_TOKENS", 1),
    "max_model_len": Bound("MAX_MODEL_LEN", 1),
    "max_loras": Bound("MAX_LORAS", 1),
    "lora_memory_mb": Bound("LORA_MEMORY_MB", 1),
    "max_cpu_loras": Bound("MAX_CPU_LORAS", 1),
    "max_lora_rank": Bound("MAX_LORA_RANK", 1, 256),
    "lora_load_workers": Bound("LORA_LOAD_WORKERS", 1),
    "lora_copy_groups_per_step": Bound("LORA_COPY_GROUPS_PER_STEP", 1),
    # 0 is no count of threads: refused here, as `loramux engine` always did, not taken as unset.
    "engine_threads": Bound("ENGINE_THREADS", 1, MAX_CPU_THREADS),
}
"""EngineConfig refuses most of these too, but only in the engine's process, naming its own
field: here they are refused where the settings are read, by their variable."""


PORTS = Bound("PORT", 1, 65535)
"""Ports serve may listen on; not 0 (any free port): its workers would each get another, and
the first start's hint could not name it."""

HOUR = 3600
# Every time setting has a ceiling, and a floor above 0 where less does harm: only infinity was
# refused above, so LORAMUX_KEY_CACHE_SECONDS=1e300 kept revoked keys working in the other
# workers for good, LORAMUX_USAGE_FLUSH_SECONDS=1e-300 spun the usage writer on the event loop,
# and LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS=1e-300 answered every request 504.
SERVER_BOUNDS = {
    "port": PORTS,
    # A second: no engine answers sooner under load; an hour: a hung engine holds no longer.
    "engine_first_output_seconds": Bound("ENGINE_FIRST_OUTPUT_SECONDS", 1, HOUR),
    # The delay of a revocation (or a disabled tenant) in the other workers: 0 (no cache) to 5 min.
    "key_cache_seconds": Bound("KEY_CACHE_SECONDS", 0, 300),
    # Below 0.1 s the writer wakes for nothing; an hour's usage is what a crash would lose.
    "usage_flush_seconds": Bound("USAGE_FLUSH_SECONDS", 0.1, HOUR),
    # An hour: an orchestrator kills a service that takes longer to stop anyway.
    "stop_grace_seconds": Bound("STOP_GRACE_SECONDS", 0, HOUR),
    # A leap year: an admin token that outlives it is one nobody would revoke in time.
    "admin_token_max_ttl": Bound("ADMIN_TOKEN_MAX_TTL", 1, 366 * 24 * HOUR),
    "max_upload_mb": Bound("MAX_UPLOAD_MB", 1),
    "max_body_kb": Bound("MAX_BODY_KB", 1),  # -1 answered every request with a body 413
    "max_header_kb": Bound("MAX_HEADER_KB", 1),  # 0 would answer every request 431
    "default_max_tokens": Bound("DEFAULT_MAX_TOKENS", 1),
    "usage_max_buffered": Bound("USAGE_MAX_BUFFERED", 1),
    "demo_adapters": Bound("DEMO_ADAPTERS", 0),
}


QUOTA_BOUNDS = {
    # The delay of a quota change: 0 (read every time) to an hour.
    "config_cache_seconds": Bound("QUOTA_CONFIG_CACHE_SECONDS", 0, HOUR),
    # Renewed every third of a lease: below a second the renewals spin and a slow event loop
    # loses slots; a dead gateway's slots stay taken a whole lease, an hour at most.
    "slot_lease_seconds": Bound("QUOTA_SLOT_LEASE_SECONDS", 1, HOUR),
    # A minute: an admission waits no longer on a Redis that does not answer.
    "redis_timeout_ms": Bound("QUOTA_REDIS_TIMEOUT_MS", 1, 60_000),
    "max_unsettled": Bound("QUOTA_MAX_UNSETTLED", 1),
}


CACHE_BOUNDS = {
    "max_entries_per_bucket": Bound("CACHE_MAX_ENTRIES_PER_BUCKET", 1),
    "mirror_mb": Bound("CACHE_MIRROR_MB", 0),  # 0: only the bucket being searched is kept
    "redis_timeout_ms": Bound("CACHE_REDIS_TIMEOUT_MS", 1, 60_000),  # as the quotas'
}


MIN_SECRET_BYTES = 32
"""The shortest admin secret taken: it signs admin tokens and, derived, the dashboard's session
cookies, which every tenant signed in holds; a shorter, guessable one could be found from a
cookie offline, and an admin token minted with it."""


def check_admin_secret(secret: str, source: str) -> None:
    """ConfigError naming `source` (never the secret) when `secret` is shorter than
    `MIN_SECRET_BYTES` bytes."""
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{source} must be at least {MIN_SECRET_BYTES} bytes (it is "
            f"{len(secret.encode())}); generate one with `openssl rand -hex 32`"
        )


def check_engine_url(url: str) -> None:
    """ConfigError naming LORAMUX_ENGINE_URLS when `url` is no address an engine listens on
    (`loramux engine --address`): tcp://HOST:PORT, or ipc://PATH. ZeroMQ refused one (" tcp://…"
    after a comma and a space, a missing port) only when the engine client connected, in a
    traceback, after serve had started its redis-server."""
    scheme, _, rest = url.partition("://")
    host, _, port = rest.rpartition(":")
    named = host not in ("", "*") and not any(c.isspace() for c in host)
    if (scheme == "ipc" and rest) or (
        scheme == "tcp" and named and port.isdigit() and PORTS.admits(int(port))
    ):
        return
    raise ConfigError(
        f"LORAMUX_ENGINE_URLS holds {url!r}, which is no engine address: tcp://HOST:PORT or "
        "ipc:///PATH"
    )


MAX_USAGE_MODEL = 200
"""The longest model name usage records (`usage_events.model` and the rollups' `model`, in
gateway.db): an adapter's name always fits (`ResolvedModel.billed_as`), and a longer base
model id is refused here. Kept here, not with those columns, so that reading the settings
needs no SQLAlchemy (engines, on the GPU image too, read them)."""


def check_model_name(name: str, source: str) -> None:
    """ConfigError naming `source` when `name`, the base model's id in the API, is longer than
    usage can record (`MAX_USAGE_MODEL`): PostgreSQL refused every event of the base model, so
    its requests were served and never billed."""
    if len(name) > MAX_USAGE_MODEL:
        raise ConfigError(
            f"{source} is {len(name)} characters long; the base model's id, which usage "
            f"records, may have at most {MAX_USAGE_MODEL}: set LORAMUX_MODEL_NAME to a shorter one"
        )
