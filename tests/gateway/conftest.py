"""A real gateway on loopback: uvicorn, SQLite, the in-process engine on the demo model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server import RunningServer
from tests.gateway.servers import gateway_server


@pytest.fixture(scope="session")
def gateway(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[RunningServer]:
    with gateway_server(demo_model_dir, tmp_path_factory.mktemp("gateway-data"), redis_url) as s:
        yield s


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
