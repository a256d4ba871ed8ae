"""One settings object for every process, read from `LORAMUX_*` environment variables.

Every field has an embedded default that needs nothing configured: data under `./.loramux`, the
demo model built there on first start, a private redis-server and an engine process started by
`loramux serve`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loramux.engine.config import DTYPES, EngineConfig
from loramux.gateway.setting_checks import (
    CACHE_BOUNDS,
    ENGINE_BOUNDS,
    QUOTA_BOUNDS,
    SERVER_BOUNDS,
    ConfigError,
    check_admin_secret,
    check_bounds,
    check_engine_url,
    check_model_name,
    env_value,
)


def private_folder(path: Path) -> Path:
    """`path`, created when missing (its missing parents too) readable by this user only
    (0700): the data directory holds the database, the admin secret and tenants' adapters."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


ENGINE_FIRST_OUTPUT_SECONDS = 120.0
"""How long a gateway waits for an engine's first output of a request by default: time enough
for a long queue, or the prefill of a long prompt on slow hardware."""


def _engine_default(name: str) -> Any:
    """EngineConfig's own default of its field `name`: the settings never repeat one."""
    return EngineConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class EngineSettings:
    """The engine's knobs; each defaults to EngineConfig's own default. `engine_config` is the
    one mapping to EngineConfig, used by serve's engine, the command line and the benchmarks."""

    dtype: str = field(default_factory=lambda: env_value("DTYPE", _engine_default("dtype")))
    """LORAMUX_DTYPE: float32, float16 or bfloat16."""
    device: str = field(default_factory=lambda: env_value("DEVICE", _engine_default("device")))
    """LORAMUX_DEVICE: torch device of the engine (cpu, cuda, cuda:1)."""
    kv_cache_mb: int = field(
        default_factory=lambda: env_value(
            "KV_CACHE_MB", _engine_default("kv_cache_bytes") >> 20, int
        )
    )
    """LORAMUX_KV_CACHE_MB: memory budget of the paged KV cache (and, on CUDA, decode graphs)."""
    max_num_seqs: int = field(
        default_factory=lambda: env_value("MAX_NUM_SEQS", _engine_default("max_num_seqs"), int)
    )
    """LORAMUX_MAX_NUM_SEQS: sequences running in one step at most."""
    max_waiting: int = field(
        default_factory=lambda: env_value("MAX_WAITING", _engine_default("max_waiting"), int)
    )
    """LORAMUX_MAX_WAITING: requests queued beyond those running, at most; past that the engine
    refuses (503 engine_overloaded), sharing the queue between tenants (engine.queue_share)."""
    max_num_batched_tokens: int = field(
        default_factory=lambda: env_value(
            "MAX_BATCHED_TOKENS", _engine_default("max_num_batched_tokens"), int
        )
    )
    """LORAMUX_MAX_BATCHED_TOKENS: token budget per step (decode tokens plus prefill chunks)."""
    max_model_len: int | None = field(
        default_factory=lambda: env_value("MAX_MODEL_LEN", _engine_default("max_model_len"), int)
    )
    """LORAMUX_MAX_MODEL_LEN: longest prompt plus completion; the model's context by default."""
    max_loras: int = field(
        default_factory=lambda: env_value("MAX_LORAS", _engine_default("max_loras"), int)
    )
    """LORAMUX_MAX_LORAS: adapters resident on the device at once at most (distinct adapters in
    one step); how many fit is up to LORAMUX_LORA_MEMORY_MB."""
    lora_memory_mb: int | None = field(
        default_factory=lambda: env_value("LORA_MEMORY_MB", None, int)
    )
    """LORAMUX_LORA_MEMORY_MB: device memory for resident adapters, each at its own ranks; unset:
    room for LORAMUX_MAX_LORAS adapters of LORAMUX_MAX_LORA_RANK on every projection."""
    max_cpu_loras: int = field(
        default_factory=lambda: env_value("MAX_CPU_LORAS", _engine_default("max_cpu_loras"), int)
    )
    """LORAMUX_MAX_CPU_LORAS: adapters kept parsed in host memory."""
    max_lora_rank: int = field(
        default_factory=lambda: env_value("MAX_LORA_RANK", _engine_default("max_lora_rank"), int)
    )
    """LORAMUX_MAX_LORA_RANK: largest adapter rank accepted (up to 256); uploads above are refused."""
    lora_load_workers: int | None = field(
        default_factory=lambda: env_value(
            "LORA_LOAD_WORKERS", _engine_default("lora_load_workers"), int
        )
    )
    """LORAMUX_LORA_LOAD_WORKERS: threads reading adapters from disk in parallel; unset: the
    cores, at most 4."""
    lora_copy_groups_per_step: int = field(
        default_factory=lambda: env_value(
            "LORA_COPY_GROUPS_PER_STEP", _engine_default("lora_copy_groups_per_step"), int
        )
    )
    """LORAMUX_LORA_COPY_GROUPS_PER_STEP: on the CPU, (layer, projection group) blocks of adapter
    weights copied into device slots per step (requests run on the host path meanwhile)."""
    prefix_caching: bool = field(
        default_factory=lambda: env_value(
            "PREFIX_CACHING", _engine_default("enable_prefix_caching"), bool
        )
    )
    """LORAMUX_PREFIX_CACHING: reuse the KV blocks of a prefix seen before (same tokens, same
    adapter, same tenant); 0 turns it off."""
    cuda_graphs: bool = field(
        default_factory=lambda: env_value("CUDA_GRAPHS", _engine_default("cuda_graphs"), bool)
    )
    """LORAMUX_CUDA_GRAPHS: on CUDA, decode steps replay captured CUDA graphs; 0 turns it off."""
    fused_kernels: bool = field(
        default_factory=lambda: env_value("FUSED_KERNELS", _engine_default("fused_kernels"), bool)
    )
    """LORAMUX_FUSED_KERNELS: on CUDA, the residual add with RMSNorm and rotary embedding with the
    KV cache write run as fused Triton kernels; 0 runs their torch forms."""
    async_scheduling: bool | None = field(
        default_factory=lambda: env_value(
            "ASYNC_SCHEDULING", _engine_default("async_scheduling"), bool
        )
    )
    """LORAMUX_ASYNC_SCHEDULING: prepare step N + 1 while the device computes step N; unset: on
    CUDA only, 1: everywhere, 0: never."""
    engine_threads: int | None = field(
        default_factory=lambda: env_value("ENGINE_THREADS", _engine_default("cpu_threads"), int)
    )
    """LORAMUX_ENGINE_THREADS: torch's threads in the engine's process (on a CPU, the cores the
    model runs on); unset: every core for `loramux engine`, and the cores its gateway workers
    leave for the engine `loramux serve` starts; 1 to 4096 (0 is refused, as by `loramux
    engine`)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"LORAMUX_DTYPE must be one of {', '.join(DTYPES)}, not {self.dtype!r}"
            )
        check_bounds(self, ENGINE_BOUNDS)

    def engine_config(self, model: Path, *, random_weights: bool = False) -> EngineConfig:
        """The engine's config for the model folder `model` (`random_weights`: seeded random
        weights instead of the folder's, for benchmarks of shapes that exist only as a config)."""
        return EngineConfig(
            model=model,
            random_weights=random_weights,
            dtype=self.dtype,
            device=self.device,
            kv_cache_bytes=self.kv_cache_mb << 20,
            max_num_seqs=self.max_num_seqs,
            max_waiting=self.max_waiting,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.prefix_caching,
            max_loras=self.max_loras,
            lora_memory_bytes=None if self.lora_memory_mb is None else self.lora_memory_mb << 20,
            max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=self.max_lora_rank,
            lora_load_workers=self.lora_load_workers,
            lora_copy_groups_per_step=self.lora_copy_groups_per_step,
            cuda_graphs=self.cuda_graphs,
            fused_kernels=self.fused_kernels,
            async_scheduling=self.async_scheduling,
            cpu_threads=self.engine_threads,
        )


@dataclass(frozen=True)
class ServerSettings:
    host: str = field(default_factory=lambda: env_value("HOST", "127.0.0.1"))
    """LORAMUX_HOST: address `loramux serve` listens on."""
    port: int = field(default_factory=lambda: env_value("PORT", 8000, int))
    """LORAMUX_PORT: port `loramux serve` listens on, 1 to 65535."""
    database_url: str | None = field(default_factory=lambda: env_value("DATABASE_URL", None))
    """LORAMUX_DATABASE_URL: SQLAlchemy URL (sqlite:///… or postgresql://…); SQLite in the data dir by default."""
    adapter_store_url: str | None = field(
        default_factory=lambda: env_value("ADAPTER_STORE_URL", None)
    )
    """LORAMUX_ADAPTER_STORE_URL: where engine replicas fetch adapters uploaded elsewhere: `db`
    (the gateway's database) or a SQLAlchemy URL; unset: only the data dir's adapter store."""
    redis_url: str | None = field(default_factory=lambda: env_value("REDIS_URL", None))
    """LORAMUX_REDIS_URL: Redis for quotas (and the response cache unless LORAMUX_CACHE_REDIS_URL); unset: `serve` starts its own redis-server."""
    admin_secret: str | None = field(default_factory=lambda: env_value("ADMIN_SECRET", None))
    """LORAMUX_ADMIN_SECRET: signs admin JWTs (HS256) and dashboard sessions, at least 32 bytes; generated and kept in the data dir when unset."""
    admin_public_key: str | None = field(
        default_factory=lambda: env_value("ADMIN_PUBLIC_KEY", None)
    )
    """LORAMUX_ADMIN_PUBLIC_KEY: RSA public key in PEM, its text (from -----BEGIN) or a file's
    path; when set, admin JWTs are RS256, minted elsewhere."""
    admin_token_max_ttl: int = field(
        default_factory=lambda: env_value("ADMIN_TOKEN_MAX_TTL", 24 * 3600, int)
    )
    """LORAMUX_ADMIN_TOKEN_MAX_TTL: longest lifetime in seconds of an admin JWT, minted or accepted (exp - iat and exp - now)."""
    engine_urls: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            u.strip() for u in env_value("ENGINE_URLS", "").split(",") if u.strip()
        )
    )
    """LORAMUX_ENGINE_URLS: comma-separated engine services (tcp://HOST:PORT or ipc:///PATH,
    spaces around each ignored); unset: `serve` starts its own."""
    engine_token: str | None = field(default_factory=lambda: env_value("ENGINE_TOKEN", None))
    """LORAMUX_ENGINE_TOKEN: shared secret of gateways and engine services; unset: no check."""
    metrics_token: str | None = field(default_factory=lambda: env_value("METRICS_TOKEN", None))
    """LORAMUX_METRICS_TOKEN: gateways' and engines' /metrics answer only `Authorization:
    Bearer <token>`; unset: anyone who reaches the port."""
    engine_first_output_seconds: float = field(
        default_factory=lambda: env_value(
            "ENGINE_FIRST_OUTPUT_SECONDS", ENGINE_FIRST_OUTPUT_SECONDS, float
        )
    )
    """LORAMUX_ENGINE_FIRST_OUTPUT_SECONDS: an engine that gives no first output of a request
    for this long (hung, or far behind) has the request aborted; the client gets 504
    engine_timeout."""
    model_name: str | None = field(default_factory=lambda: env_value("MODEL_NAME", None))
    """LORAMUX_MODEL_NAME: the base model's id in the API; the model folder's name by default."""
    key_cache_seconds: float = field(
        default_factory=lambda: env_value("KEY_CACHE_SECONDS", 2.0, float)
    )
    """LORAMUX_KEY_CACHE_SECONDS: how long an API-key lookup is cached (revocation delay)."""
    max_upload_mb: int = field(default_factory=lambda: env_value("MAX_UPLOAD_MB", 512, int))
    """LORAMUX_MAX_UPLOAD_MB: largest adapter upload accepted."""
    max_body_kb: int = field(default_factory=lambda: env_value("MAX_BODY_KB", 1024, int))
    """LORAMUX_MAX_BODY_KB: largest API request body accepted (413 beyond)."""
    # engine.http_heads.MAX_HEAD_KB, not imported here: it imports uvicorn (a third of a second).
    max_header_kb: int = field(default_factory=lambda: env_value("MAX_HEADER_KB", 64, int))
    """LORAMUX_MAX_HEADER_KB: largest request line and headers of a request to a gateway or an
    engine's health endpoint (431 beyond, and the connection closed)."""
    default_max_tokens: int = field(
        default_factory=lambda: env_value("DEFAULT_MAX_TOKENS", 1024, int)
    )
    """LORAMUX_DEFAULT_MAX_TOKENS: completion cap when a request gives no max_tokens (and the context allows)."""
    usage_max_buffered: int = field(
        default_factory=lambda: env_value("USAGE_MAX_BUFFERED", 250_000, int)
    )
    """LORAMUX_USAGE_MAX_BUFFERED: usage events held in memory while the database is unavailable (about 0.5 KB each); past this they are dropped, logged and counted."""
    usage_flush_seconds: float = field(
        default_factory=lambda: env_value("USAGE_FLUSH_SECONDS", 0.5, float)
    )
    """LORAMUX_USAGE_FLUSH_SECONDS: how often usage events are written to the database (sooner when many are waiting)."""
    stop_grace_seconds: int = field(
        default_factory=lambda: env_value("STOP_GRACE_SECONDS", 30, int)
    )
    """LORAMUX_STOP_GRACE_SECONDS: on SIGTERM or SIGINT, how long `serve` lets requests in flight finish before it cuts them."""
    demo_adapters: int = field(default_factory=lambda: env_value("DEMO_ADAPTERS", 4, int))
    """LORAMUX_DEMO_ADAPTERS: shared demo adapters uploaded on first start with the demo model."""

    def __post_init__(self) -> None:
        check_bounds(self, SERVER_BOUNDS)
        for url in self.engine_urls:
            check_engine_url(url)
        store = None if self.adapter_store_url == "db" else self.adapter_store_url
        if self.database_url is not None or store is not None:
            # Imported only with a URL to check: engines, on the GPU image too, need no SQLAlchemy.
            from loramux.gateway.db.session import check_database_url

            check_database_url(self.database_url, "DATABASE_URL")
            check_database_url(store, "ADAPTER_STORE_URL")
        if self.admin_secret is not None:
            check_admin_secret(self.admin_secret, "LORAMUX_ADMIN_SECRET")
        if self.admin_public_key is not None:
            from loramux.gateway.auth.admin_key import admin_public_key_pem

            admin_public_key_pem(self.admin_public_key)  # refused now, not at every token


@dataclass(frozen=True)
class QuotaSettings:
    on_redis_down: str = field(default_factory=lambda: env_value("QUOTA_ON_REDIS_DOWN", "reject"))
    """LORAMUX_QUOTA_ON_REDIS_DOWN: `reject` (503 quota_unavailable) or `allow` (admit unchecked, logged and counted) when Redis cannot be reached."""
    redis_timeout_ms: int = field(
        default_factory=lambda: env_value("QUOTA_REDIS_TIMEOUT_MS", 1000, int)
    )
    """LORAMUX_QUOTA_REDIS_TIMEOUT_MS: how long an admission waits for Redis before Redis counts as down."""
    config_cache_seconds: float = field(
        default_factory=lambda: env_value("QUOTA_CONFIG_CACHE_SECONDS", 1.0, float)
    )
    """LORAMUX_QUOTA_CONFIG_CACHE_SECONDS: how long a key's quota rows are cached (delay before a quota change applies)."""
    slot_lease_seconds: float = field(
        default_factory=lambda: env_value("QUOTA_SLOT_LEASE_SECONDS", 30.0, float)
    )
    """LORAMUX_QUOTA_SLOT_LEASE_SECONDS: a concurrency slot not renewed for this long (its gateway died) is freed."""
    max_unsettled: int = field(
        default_factory=lambda: env_value("QUOTA_MAX_UNSETTLED", 100_000, int)
    )
    """LORAMUX_QUOTA_MAX_UNSETTLED: settlements a gateway keeps while Redis cannot take them, retried until it answers; past this, the oldest is dropped (its reservation stays charged)."""

    def __post_init__(self) -> None:
        if self.on_redis_down not in ("reject", "allow"):
            raise ConfigError(
                f"LORAMUX_QUOTA_ON_REDIS_DOWN must be 'reject' or 'allow', not {self.on_redis_down!r}"
            )
        check_bounds(self, QUOTA_BOUNDS)


@dataclass(frozen=True)
class CacheSettings:
    redis_url: str | None = field(default_factory=lambda: env_value("CACHE_REDIS_URL", None))
    """LORAMUX_CACHE_REDIS_URL: the response cache's own Redis (allkeys-lru), apart from the quotas' (noeviction); LORAMUX_REDIS_URL when unset."""
    max_entries_per_bucket: int = field(
        default_factory=lambda: env_value("CACHE_MAX_ENTRIES_PER_BUCKET", 10_000, int)
    )
    """LORAMUX_CACHE_MAX_ENTRIES_PER_BUCKET: semantic entries kept per conversation context (least recently used out first)."""
    mirror_mb: int = field(default_factory=lambda: env_value("CACHE_MIRROR_MB", 256, int))
    """LORAMUX_CACHE_MIRROR_MB: memory for this process's copies of the semantic buckets it searches."""
    redis_timeout_ms: int = field(
        default_factory=lambda: env_value("CACHE_REDIS_TIMEOUT_MS", 500, int)
    )
    """LORAMUX_CACHE_REDIS_TIMEOUT_MS: a cache lookup or store waiting longer on Redis is given up (served uncached)."""

    def __post_init__(self) -> None:
        check_bounds(self, CACHE_BOUNDS)


@dataclass(frozen=True)
class Settings:
    data_dir: Path = field(
        default_factory=lambda: Path(env_value("DATA_DIR", "./.loramux")).resolve()
    )
    """LORAMUX_DATA_DIR: where the database, adapters, secrets and the demo model live (created
    0700 by `private_folder`)."""
    model: Path | None = field(default_factory=lambda: env_value("MODEL", None, Path))
    """LORAMUX_MODEL: a Hugging Face folder of a Llama-family model; the demo model when unset."""
    engine: EngineSettings = field(default_factory=EngineSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    quotas: QuotaSettings = field(default_factory=QuotaSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)

    def __post_init__(self) -> None:
        if self.server.model_name:
            check_model_name(self.model_name, "LORAMUX_MODEL_NAME")
        else:
            folder = f"the model folder's name (LORAMUX_MODEL={self.model_dir}"
            check_model_name(self.model_name, f"{folder}; LORAMUX_MODEL_NAME unset)")

    @property
    def database_url(self) -> str:
        return self.server.database_url or f"sqlite:///{self.data_dir / 'loramux.db'}"

    @property
    def shared_adapter_store_url(self) -> str | None:
        """The database of the shared adapter store (gateway.adapters.shared_store), if any."""
        url = self.server.adapter_store_url
        return self.database_url if url == "db" else url

    @property
    def adapter_dir(self) -> Path:
        """The content-addressed adapter store."""
        return self.data_dir / "adapters"

    @property
    def model_name(self) -> str:
        return self.server.model_name or self.model_dir.name

    @property
    def model_dir(self) -> Path:
        return self.model if self.model is not None else self.data_dir / "demo-model"

    def create_data_dir(self) -> Path:
        """The data directory, created owner-only when missing (`private_folder`); a ConfigError
        naming LORAMUX_DATA_DIR when it cannot be created or written, before a command starts
        anything that would fail in it later, with a traceback."""
        try:
            private_folder(self.data_dir)
        except OSError as exc:
            raise ConfigError(
                f"LORAMUX_DATA_DIR={self.data_dir} cannot be created: {exc.strerror or exc}"
            ) from None
        if not os.access(self.data_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"LORAMUX_DATA_DIR={self.data_dir} is not writable by this user")
        return self.data_dir

    def describe(self) -> dict[str, Any]:
        """Settings as plain values, for logs and `/ready`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = (
                dict(value.__dict__) if hasattr(value, "__dataclass_fields__") else str(value)
            )
        out["server"].pop("admin_secret", None)
        out["server"].pop("engine_token", None)
        out["server"].pop("metrics_token", None)
        return out
