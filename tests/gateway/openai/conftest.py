"""A tenant of the OpenAI routes' tests, its clients, and the admin client that made it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_tenant


@pytest.fixture(scope="module")
def admin_module(gateway: RunningServer, admin_token: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=120
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tenant(admin_module: httpx.Client) -> TenantKey:
    return new_tenant(admin_module, "oai")


@pytest.fixture
def api(gateway: RunningServer, tenant: TenantKey) -> Iterator[httpx.Client]:
    """Plain HTTP as the tenant (for what the openai client cannot send)."""
    with httpx.Client(
        base_url=f"{gateway.url}/v1", headers={"authorization": f"Bearer {tenant.key}"}, timeout=60
    ) as c:
        yield c


@pytest.fixture
def oai(gateway: RunningServer, tenant: TenantKey) -> openai.OpenAI:
    """The official client as the tenant."""
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
    )
