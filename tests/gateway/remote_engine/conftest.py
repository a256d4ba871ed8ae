"""Two real engine services on loopback (tcp://), a client of the first, and a local engine to
compare with: each test module of the remote engine client gets its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine.conftest import make_engine
from tests.gateway.servers import ENGINE_TOKEN, engine_service


@pytest.fixture(scope="module")
def services(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[RunningEngineService]]:
    with (
        engine_service(demo_model_dir, tmp_path_factory.mktemp("engine-a")) as a,
        engine_service(demo_model_dir, tmp_path_factory.mktemp("engine-b")) as b,
    ):
        yield [a, b]


@pytest.fixture(scope="module")
async def client(services: list[RunningEngineService]) -> AsyncIterator[RemoteEngineClient]:
    """A client of the first engine only."""
    remote = RemoteEngineClient([services[0].url], ENGINE_TOKEN)
    await remote.start()
    yield remote
    await remote.close()


@pytest.fixture(scope="module")
def local(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir)
