"""QuotaService against a real Redis and a real SQLite database, with a clock the test moves."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import create_engine, session_factory
from tests.gateway.quotas.rig import Clock, QuotaRig


@pytest.fixture(scope="session")
def quota_db_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('quota-db') / 'loramux.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
async def sessions(quota_db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(quota_db_url)
    yield session_factory(engine)
    await engine.dispose()


@pytest.fixture
async def rig(
    redis_url: str, sessions: async_sessionmaker[AsyncSession]
) -> AsyncIterator[QuotaRig]:
    rig = QuotaRig(redis_url, sessions, Clock(), [])
    yield rig
    for svc in rig.services:
        await svc.close()
        await svc.redis.aclose()
