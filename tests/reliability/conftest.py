"""A gateway per test module (uvicorn on loopback, SQLite, the in-process engine on the demo
model, the session's Redis: what one module's hostile requests do to it cannot fail another
module's tests) and the few adapters the tenants own and share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loramux.gateway.server import RunningServer
from tests.reliability.rig import gateway_settings, serve


@pytest.fixture(scope="session")
def adapter_dirs(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Five PEFT adapters for the demo model (the session's forty take far longer to build)."""
    from loramux.adapters.demo import build_demo_adapters

    return build_demo_adapters(demo_model_dir, tmp_path_factory.mktemp("adapters"), 5, seed=1)


@pytest.fixture(scope="module")
def gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    # Redis is not what these modules try: a machine busy enough to delay its answers past the
    # default timeouts must not turn into refusals (the fault modules keep the defaults).
    settings = gateway_settings(
        demo_model_dir, tmp_path_factory.mktemp("gateway"), redis_timeout_ms=30_000
    )
    with serve(settings, redis_url) as server:
        yield server
