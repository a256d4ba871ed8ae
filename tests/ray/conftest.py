"""One local Ray cluster per test module, with the engine deployment on the demo model: 3 CPU
replicas (half a core each) reading 12 demo adapters from one shared adapter store."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Ray Serve's routers (read when ray.serve is imported) probe a replica's queue length before
# sending it a request, and treat a probe slower than 0.1 s as "busy": an adapter's request
# then goes to another replica. On 2 shared cores a replica computing a batch answers slower,
# so the tests give probes the time a loaded machine needs; docs/architecture.md says why.
ROUTER_PROBE_DEADLINES = {
    "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5",
    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10",
}
for _name, _value in ROUTER_PROBE_DEADLINES.items():
    os.environ.setdefault(_name, _value)
# Ray's head waits 30 s for its GCS server to listen; other work on 2 shared cores has made that
# take longer.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")
from ray import serve  # noqa: E402

from loramux.adapters.base_spec import BaseModelSpec  # noqa: E402
from loramux.adapters.store import AdapterStore  # noqa: E402
from loramux.engine.config import EngineConfig  # noqa: E402
from loramux.engine.ray_deployment import (  # noqa: E402
    EngineDeploymentOptions,
    engine_deployment,
)
from loramux.gateway.engine_client.ray import RayEngineClient  # noqa: E402

ENGINE_REPLICAS = 3
ADAPTERS = 12
REPO = Path(__file__).resolve().parents[2]


@dataclass
class RayEngines:
    client: RayEngineClient
    store: AdapterStore
    digests: list[str]
    """The 12 adapters' digests; digests[i] is the adapter in folder adapter_dirs[i]."""
    adapter_dirs: list[Path]


def start_ray(http_port: int | None = None) -> None:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for name in (
        "TRITON_INTERPRET",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        *ROUTER_PROBE_DEADLINES,
    ):
        if name in os.environ:
            env[name] = os.environ[name]
    for attempt in (1, 2):  # a local head on a loaded 2-core machine sometimes misses its
        try:  # start-up deadline ("The current node timed out during startup"): once more
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                log_to_driver=False,
                runtime_env={"env_vars": env},
                configure_logging=False,
            )
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    if http_port is None:
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})


def stop_ray() -> None:
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_engines(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayEngines]:
    store = AdapterStore(
        tmp_path_factory.mktemp("shared-adapters"), BaseModelSpec.from_model_dir(demo_model_dir)
    )
    folders = demo_adapter_dirs[:ADAPTERS]
    digests = [store.put(folder).digest for folder in folders]
    start_ray()
    try:
        config = EngineConfig(model=demo_model_dir, max_model_len=512, num_kv_blocks=256)
        options = EngineDeploymentOptions(num_replicas=ENGINE_REPLICAS, num_cpus=0.5)
        app: Any = engine_deployment(config, "demo", store.root, options)
        handle = serve.run(app, name="loramux-engine", route_prefix=None)
        yield RayEngines(RayEngineClient(handle), store, digests, folders)
    finally:
        stop_ray()
