"""loramux as a Ray Serve application: gateway replicas (the Litestar app as the ingress) in front
of engine replicas (engine.ray_deployment), each gateway reaching the engines through a
deployment handle with adapter-affinity multiplexing (gateway.engine_client.ray).

Gateways keep no state of their own (Redis and SQL hold it), so Ray Serve may run, restart and
scale any number of them. Uploads go to the adapter store under the data directory
and, with LORAMUX_ADAPTER_STORE_URL, to the shared adapter store in the database, from which an
engine replica on any machine fetches an adapter it has not seen (no shared volume needed).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Litestar
from ray import serve
from ray.serve.handle import DeploymentHandle

from loramux.engine.ray_deployment import EngineDeploymentOptions, engine_deployment
from loramux.gateway.adapters.shared_store import SharedAdapterStore
from loramux.gateway.app import create_app
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.engine_client.ray import RayEngineClient
from loramux.gateway.settings import Settings
from loramux.gateway.state import build_state


@dataclass(frozen=True)
class GatewayDeploymentOptions:
    num_replicas: int | str = 2
    """A count, or "auto" to autoscale with `autoscaling`."""
    num_cpus: float = 1.0
    max_ongoing_requests: int = 256
    autoscaling: dict[str, Any] | None = None


DEFAULT_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 8,
    "target_ongoing_requests": 32,
    "upscale_delay_s": 10,
    "downscale_delay_s": 300,
}
"""Engine autoscaling defaults (`--engine-replicas auto`): a replica per GPU, scaled on the
requests queued at each; a slow downscale keeps adapters and prefix blocks warm."""


class GatewayIngress:
    """One gateway replica; Ray Serve builds the Litestar app on the replica."""

    def __init__(self, settings: Settings, redis_url: str, engines: DeploymentHandle):
        self.settings = settings
        self.redis_url = redis_url
        self.engines = engines

    async def process(self) -> int:
        """This replica's process id (operators and the fault drills find a replica by it)."""
        return os.getpid()

    async def __serve_build_asgi_app__(self) -> Litestar:
        settings = self.settings
        client = RayEngineClient(self.engines, settings.server.engine_first_output_seconds)
        state = await build_state(settings, client, settings.model_dir, self.redis_url)
        return create_app(state)


def shared_store_factory(settings: Settings) -> Callable[[], SharedAdapterStore] | None:
    """What makes each engine replica's shared adapter store (LORAMUX_ADAPTER_STORE_URL)."""
    url = settings.shared_adapter_store_url
    return None if url is None else functools.partial(SharedAdapterStore.from_url, url)


def loramux_application(
    settings: Settings,
    redis_url: str,
    gateways: GatewayDeploymentOptions,
    engines: EngineDeploymentOptions,
) -> Any:
    """The bound application: `serve.run(loramux_application(...), route_prefix="/")`. The
    database is migrated here, once, before any gateway replica starts."""
    upgrade(settings.database_url)
    model_dir = settings.model_dir
    engine_app = engine_deployment(
        settings.engine.engine_config(model_dir),
        settings.model_name,
        settings.adapter_dir,
        engines,
        shared_store_factory(settings),
    )
    gateway = serve.deployment(
        name="LoramuxGateway",
        num_replicas=gateways.num_replicas,
        ray_actor_options={"num_cpus": gateways.num_cpus},
        max_ongoing_requests=gateways.max_ongoing_requests,
        autoscaling_config=gateways.autoscaling,
    )(serve.ingress()(GatewayIngress))
    return gateway.bind(settings, redis_url, engine_app)


def replicas(value: str) -> int | str:
    """A replica count from the command line or a config: a positive integer, or "auto"."""
    if value == "auto":
        return value
    count = int(value)
    if count < 1:
        raise ValueError(f"a replica count is at least 1, not {count}")
    return count


def application_from_args(args: dict[str, str]) -> Any:
    """The application for `serve run loramux.gateway.ray_app:application_from_args` and for
    docker/ray/serve_config.yaml: settings from LORAMUX_* variables (LORAMUX_REDIS_URL is
    required: every gateway replica must share one Redis), replica counts from `args`:
    `gateway_replicas` (default 2), `engine_replicas` (default "auto"), `engine_gpus` per
    engine replica (default 1), `engine_cpus` (default 1)."""
    settings = Settings()
    redis_url = settings.server.redis_url
    if redis_url is None:
        raise ValueError("LORAMUX_REDIS_URL must name the Redis every gateway replica shares")
    engine_replicas = replicas(args.get("engine_replicas", "auto"))
    engines = EngineDeploymentOptions(
        num_replicas=engine_replicas,
        num_cpus=float(args.get("engine_cpus", "1")),
        num_gpus=float(args.get("engine_gpus", "1")),
        autoscaling=DEFAULT_AUTOSCALING if engine_replicas == "auto" else None,
    )
    gateways = GatewayDeploymentOptions(num_replicas=replicas(args.get("gateway_replicas", "2")))
    return loramux_application(settings, redis_url, gateways, engines)


def run_forever(address: str, host: str, port: int, args: dict[str, str]) -> None:
    """`loramux ray-serve`: deploy on the Ray cluster at `address` and serve until interrupted."""
    import ray

    ray.init(address=address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application_from_args(args), name="loramux", route_prefix="/", blocking=True)
