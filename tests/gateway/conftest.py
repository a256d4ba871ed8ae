"""A real gateway on loopback: uvicorn, SQLite, the in-process engine on the demo model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.db.migrate import upgrade
from gateway.server import RunningServer, engine_client, serve_in_thread
from gateway.settings import Settings


@pytest.fixture(scope="session")
def gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("gateway-data")
    env = {
        "LORAMUX_DATA_DIR": str(data),
        "LORAMUX_MODEL": str(demo_model_dir),
        "LORAMUX_MODEL_NAME": "demo-model",
        "LORAMUX_MAX_MODEL_LEN": "512",
        "LORAMUX_KV_CACHE_MB": "32",
        "LORAMUX_KEY_CACHE_SECONDS": "0.5",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = Settings()
        upgrade(settings.database_url)
        client = engine_client(settings, demo_model_dir)
        with serve_in_thread(settings, client, demo_model_dir, redis_url=redis_url) as server:
            yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def admin_token(gateway: RunningServer) -> str:
    return gateway.state.admin.mint("test-admin", ttl_seconds=3600)


@pytest.fixture
def admin(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    """An HTTP client carrying the admin token."""
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=60
    ) as c:
        yield c


def json_of(response: httpx.Response) -> Any:
    assert response.headers.get("content-type", "").startswith("application/json"), response.text
    return response.json()
