"""The engine as a Ray Serve deployment: one replica per GPU (CPU replicas in tests), each wrapping
an AsyncEngine, with the adapter digest as Ray Serve's multiplexed model id.

Ray Serve routes a request whose `multiplexed_model_id` a replica already holds to that replica,
which is our adapter affinity: the adapter's weights and its prefix-cache blocks are there. A
replica asked for a digest it does not hold loads it from its local adapter store (the
content-addressed directory), fetching it first from the shared adapter store when one is
configured (the database: gateway.adapters.shared_store, so no directory is shared between
machines), and registers it; Ray Serve's LRU over
`max_num_models_per_replica` (the engine's CPU adapter tier) then decides what each replica is
known to hold.

Requests and outputs cross Ray as the engine's own dataclasses (EngineRequest, RequestOutput),
pickled by Ray; a Ray client never sends text, only token ids, like the ZeroMQ channel.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from ray import serve

from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.outputs import EngineRequest, RequestOutput

BASE_MODEL_ID = "base"
"""The multiplexed model id of requests without an adapter (never a digest: digests are hex)."""


class AdapterSource(Protocol):
    """Where a replica fetches adapters it has not stored itself (gateway.adapters.shared_store)."""

    async def fetch(self, digest: str, into: AdapterStore) -> StoredAdapter | None: ...


@dataclass(frozen=True)
class ReplicaStats:
    """What one engine replica reports about itself: who it is and what it served."""

    replica: str
    pid: int
    served: dict[str, int]
    """Requests started here, by adapter digest (BASE_MODEL_ID for the base model)."""
    engine: dict[str, Any]
    """engine.outputs.EngineStats as a dict."""
    adapter_root: str = ""
    """The local adapter store this replica serves from."""


class EngineReplica:
    """One engine replica. Ray Serve constructs it in a replica process (see `engine_deployment`)."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        adapter_dir: Path,
        adapter_source: Callable[[], AdapterSource] | None = None,
    ):
        self.model_name = model_name
        self.source = None if adapter_source is None else adapter_source()
        self.engine = AsyncEngine.from_config(config)
        self.engine.start()
        lora = self.engine.engine.lora
        if self.source is not None:  # a store of its own, filled from the shared one
            adapter_dir = Path(tempfile.mkdtemp(prefix="loramux-replica-adapters-"))
        self.store = None if lora is None else AdapterStore(adapter_dir, lora.base, lora.limits)
        self.served: Counter[str] = Counter()
        capacity = config.max_cpu_loras if lora is not None else 1

        async def load_adapter(digest: str) -> str:
            return await self._register(digest)

        # Set per instance so that the capacity follows the engine's configuration; Ray Serve
        # detects a multiplexed loader wired up at init time.
        self._load: Callable[[str], Awaitable[str]] = serve.multiplexed(
            max_num_models_per_replica=capacity
        )(load_adapter)

    async def _register(self, digest: str) -> str:
        if digest == BASE_MODEL_ID:
            return digest
        if self.store is None:
            raise InvalidRequestError("this engine was started without LoRA support")
        try:
            stored = self.store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if stored is None and self.source is not None:
            stored = await self.source.fetch(digest, self.store)
        if stored is None:
            raise UnknownAdapterError(f"unknown adapter {digest!r}")
        await self.engine.register_adapter(stored.path)
        return digest

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs; typed engine errors are raised before the first one. Ray
        cancelling the stream (the caller went away) closes the engine's stream, which aborts
        the sequence and frees its KV blocks."""
        if request.prompt_token_ids is None:
            raise InvalidRequestError("the engine takes prompts as token ids")
        # The request's adapter decides what runs; its multiplexed model id (the same digest,
        # from gateway.engine_client.ray) only steered Ray Serve's choice of this replica.
        digest = request.adapter or BASE_MODEL_ID
        await self._load(digest)
        self.served[digest] += 1
        outputs = self.engine.generate(request)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]  # aborts an unfinished one

    async def abort(self, request_id: str, choice: int | None = None) -> None:
        self.engine.abort(request_id, choice)

    async def info(self) -> dict[str, Any]:
        llm = self.engine.engine
        return {
            "model_name": self.model_name,
            "max_model_len": llm.max_model_len,
            "vocab_size": llm.model_config.vocab_size,
        }

    async def stats(self) -> ReplicaStats:
        context = serve.get_replica_context()
        return ReplicaStats(
            context.replica_tag if context is not None else "",
            os.getpid(),
            dict(self.served),
            asdict(self.engine.stats()),
            "" if self.store is None else str(self.store.root),
        )

    async def metrics(self) -> str:
        return self.engine.engine.metrics.render()

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose step thread died is restarted."""
        if not self.engine.running:
            raise RuntimeError("the engine's step loop is not running")


@dataclass(frozen=True)
class EngineDeploymentOptions:
    """How many engine replicas and what each holds. Production: one GPU per replica."""

    num_replicas: int | str = 1
    """A count, or "auto" to autoscale with `autoscaling`."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 64
    """Requests one replica takes at once; beyond it Ray Serve queues (and autoscales on it)."""
    autoscaling: dict[str, Any] | None = None


def engine_deployment(
    config: EngineConfig,
    model_name: str,
    adapter_dir: Path,
    options: EngineDeploymentOptions,
    adapter_source: Callable[[], AdapterSource] | None = None,
) -> Any:
    """The bound engine application (`serve.run` it, or compose it into the gateway's);
    `adapter_source` makes each replica's shared adapter store (called in the replica)."""
    deployment = serve.deployment(
        name="LoramuxEngine",
        num_replicas=options.num_replicas,
        ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": options.num_gpus},
        max_ongoing_requests=options.max_ongoing_requests,
        autoscaling_config=options.autoscaling,
        health_check_period_s=2,
    )(EngineReplica)
    return deployment.bind(config, model_name, adapter_dir, adapter_source)
