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

With a shared adapter store a replica keeps what it fetched in an adapter folder of its own
(engine.adapter_folder: `<temporary folder>/loramux-replica-adapters/run-<pid>-<hex>`, removed
when Ray Serve stops the replica, and by the next replica to start on the host when it was
killed), and a digest's files leave it when the engine drops the digest. Deletes reach the
replica by polling: a handle cannot broadcast a retire to every replica, and no replica is told
of a delete, so every RETIRE_CHECK_SECONDS each replica asks the shared store which of the
digests in its folder it still has, and retires the others (see `_retire_deleted`).

Requests and outputs cross Ray as the engine's own dataclasses (EngineRequest, RequestOutput),
pickled by Ray; a Ray client never sends text, only token ids, like the ZeroMQ channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from ray import serve
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from loramux.adapters.store import AdapterStore, StoredAdapter
from loramux.engine.adapter_folder import EngineAdapterFolder
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.config import EngineConfig
from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.identity import engine_build
from loramux.engine.outputs import EngineRequest, RequestOutput

log = logging.getLogger(__name__)

BASE_MODEL_ID = "base"
"""The multiplexed model id of requests without an adapter (never a digest: digests are hex)."""
REPLICA_ADAPTERS = "loramux-replica-adapters"
"""The root of the replicas' own adapter folders, in the host's temporary folder."""
RETIRE_CHECK_SECONDS = 1.0
"""How often a replica asks the shared store which of its adapters were deleted: the most a
deleted adapter's weights stay on its disk, past its last request and the query's time."""


class AdapterSource(Protocol):
    """Where a replica fetches adapters it has not stored itself (gateway.adapters.shared_store)."""

    async def fetch(self, digest: str, into: AdapterStore) -> StoredAdapter | None: ...

    async def present(self, digests: Collection[str]) -> set[str]: ...


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


@dataclass(frozen=True)
class ReplicaMetrics:
    """One engine replica's Prometheus text (engine.metrics), named by the replica's id."""

    replica: str
    text: str


class StreamReplicaRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's power-of-two-choices routing (adapter affinity through multiplexing), except
    that `abort(request_id, choice)` goes to the replica running that request's stream: a
    choice a stop string ended stops there alone, as on the local engine, while a handle call
    would reach any replica. It runs in each handle's process, so it learns where each
    `generate` went (`on_request_routed`) and forgets it when the stream ends.

    Each request is given the replica chosen for it (Ray Serve's default router may hand one
    chosen for a request to the oldest one waiting instead, which would send an abort astray).
    An abort whose stream's replica is gone (or whose stream ended) goes to any replica, where
    it finds nothing to stop. Like any call, it waits while its replica is at
    `max_ongoing_requests`."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Called by Ray Serve once the router is made."""
        self._runs: dict[str, ReplicaID] = {}
        """Our request id of each stream under way → the replica running it."""
        self._requests: dict[str, str] = {}
        """Ray Serve's internal request id of each stream → our request id."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The stream's replica for an abort; power of two choices for any other call."""
        if pending_request is not None and pending_request.metadata.call_method == "abort":
            target = self._runs.get(pending_request.args[0])
            chosen = [r for r in candidate_replicas if r.replica_id == target]
            if chosen:
                return [chosen]
        ranks: list[list[RunningReplica]] = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self,  # type: ignore[arg-type]  # uses only the mixins' methods, which this has
            candidate_replicas,
            pending_request,
        )
        return ranks

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Remember which replica runs a `generate` stream (for its aborts)."""
        metadata = pending_request.metadata
        request = pending_request.args[0] if pending_request.args else None
        if metadata.call_method == "generate" and isinstance(request, EngineRequest):
            self._runs[request.request_id] = replica_id
            self._requests[metadata.internal_request_id] = request.request_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Forget a stream that ended (unless a retry of its request runs elsewhere now)."""
        request_id = self._requests.pop(internal_request_id, None)
        if request_id is not None and self._runs.get(request_id) == replica_id:
            del self._runs[request_id]


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
        self._closed = False
        self._checks: asyncio.Task[None] | None = None
        lora = self.engine.engine.lora
        self.folder: EngineAdapterFolder | None = None
        """With a shared adapter store: this replica's own folder, filled from it."""
        self.store: AdapterStore | None = None
        if lora is not None and self.source is not None:
            root = Path(tempfile.gettempdir()) / REPLICA_ADAPTERS
            self.folder = EngineAdapterFolder(self.engine, root)
            self.store = self.folder.store
        elif lora is not None:  # the gateways' store, on a volume they share with replicas
            self.store = AdapterStore(adapter_dir, lora.base, lora.limits)
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
        if self.folder is not None and self.source is not None:
            self._start_checks(self.folder, self.source)
            source = self.source

            async def fetch(into: AdapterStore) -> StoredAdapter | None:
                return await source.fetch(digest, into)

            if not await self.folder.register_from(digest, fetch):
                raise UnknownAdapterError(f"unknown adapter {digest!r}")
            return digest
        try:
            stored = self.store.get(digest)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if stored is None:
            raise UnknownAdapterError(f"unknown adapter {digest!r}")
        await self.engine.register_adapter(stored.path)
        return digest

    def _start_checks(self, folder: EngineAdapterFolder, source: AdapterSource) -> None:
        """From the first adapter on: its files leave with it, and deletes are looked for."""
        if self._checks is None:
            folder.start()
            self._checks = asyncio.get_running_loop().create_task(
                self._retire_deleted(folder, source)
            )

    async def _retire_deleted(self, folder: EngineAdapterFolder, source: AdapterSource) -> None:
        """Every RETIRE_CHECK_SECONDS, retire the digests in this replica's folder that the
        shared store no longer has: the last live version naming them was deleted (tenants'
        deletes included), and the gateways already resolve no request to them. Requests in
        flight finish; the engine then drops the digest and its files go (at once when none
        uses it). A digest the engine does not hold (its registration failed) goes at once.

        Polling, because no replica is told of a delete (a handle reaches one replica, not
        each) and the gateway has no list of replicas; a per-request check would miss the
        idle replica that keeps a deleted tenant's weights. One indexed query a second per
        replica costs little. A digest stored again later (the same bytes re-uploaded) is
        registered again on its next request (`generate`)."""
        while True:
            await asyncio.sleep(RETIRE_CHECK_SECONDS)
            assert folder.store is not None  # a folder is made only for a LoRA engine
            stored = await asyncio.to_thread(folder.store.digests)
            if not stored:
                continue
            try:
                gone = set(stored) - await source.present(stored)
            except Exception:  # the database unreachable for now: the next round asks again
                log.warning("could not check the shared adapter store", exc_info=True)
                continue
            for digest in sorted(gone):
                if not self.engine.retire_adapter(digest):
                    await folder.remove(digest)

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
        lora = self.engine.engine.lora
        if digest != BASE_MODEL_ID and lora is not None and not lora.is_servable(digest):
            # Retired here since Ray Serve's cache took it (deleted, then stored again): the
            # cache does not call the loader again, so register it anew (or refuse it).
            await self._register(digest)
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
            "model_identity": llm.model_identity,
            "build": engine_build(),
        }

    async def stats(self) -> ReplicaStats:
        return ReplicaStats(
            _replica_id(),
            os.getpid(),
            dict(self.served),
            asdict(self.engine.stats()),
            "" if self.store is None else str(self.store.root),
        )

    async def metrics(self) -> ReplicaMetrics:
        return ReplicaMetrics(_replica_id(), self.engine.engine.metrics.render())

    async def check_health(self) -> None:
        """Ray Serve's health check: a replica whose step thread died is restarted."""
        if not self.engine.running:
            raise RuntimeError("the engine's step loop is not running")

    def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica (scaled down, redeployed, deleted,
        shut down), after its requests drained: the engine stops and the replica's adapter
        folder is removed. A replica killed outright leaves its folder to the next replica that
        starts on the host (engine.adapter_folder). Python may call it again, or on a replica
        whose constructor failed: it acts once, on what was built."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._checks is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                self._checks.cancel()
        self.engine.shutdown()
        folder = getattr(self, "folder", None)
        if folder is not None:
            folder.close()


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
        request_router_config={"request_router_class": StreamReplicaRouter},
    )(EngineReplica)
    return deployment.bind(config, model_name, adapter_dir, adapter_source)


def _replica_id() -> str:
    """Ray Serve's unique id of this replica ("" outside a replica): a replica started in its
    place gets another."""
    context = serve.get_replica_context()
    return context.replica_tag if context is not None else ""
