"""The usage recorder under failure: no event is lost across a database outage (they wait, in a
bounded buffer, and are written once it is back), none is stored twice when a write's commit
went through but its reply was lost, an event the database refuses is dropped alone without
stopping the others, and every drop is counted and logged with its fields."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest
from sqlalchemy import func, pool, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from loramux.gateway.db import UsageEvent, usage_daily
from loramux.gateway.db.migrate import upgrade
from loramux.gateway.db.session import async_url, create_engine, session_factory
from loramux.gateway.usage import UsageRecord, UsageRecorder
from loramux.gateway.usage.recorder import UsageUnavailable
from tests.gateway.test_usage_rollups import assert_rollups_match_events, random_events
from tests.migrations.test_revisions import new_postgres_database

Sessions = async_sessionmaker[AsyncSession]


async def eventually(condition: Callable[[], bool], message: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.02)


async def stored(sessions: Sessions) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count(UsageEvent.id))) or 0)


async def eventually_stored(sessions: Sessions, count: int) -> None:
    deadline = time.monotonic() + 60
    while (n := await stored(sessions)) != count:
        assert time.monotonic() < deadline, f"{n} events stored, not {count}"
        await asyncio.sleep(0.05)


class Outage:
    """Takes one PostgreSQL database away from its clients and gives it back: while it is away,
    its open connections are terminated and new ones are refused by the server."""

    def __init__(self, database_url: str):
        self.name = make_url(database_url).database
        server = make_url(database_url).set(database="postgres")
        self.admin = create_async_engine(
            async_url(server.render_as_string(hide_password=False)),
            isolation_level="AUTOCOMMIT",
            poolclass=pool.NullPool,
        )

    async def _run(self, *statements: str) -> None:
        async with self.admin.connect() as connection:
            for statement in statements:
                await connection.execute(text(statement))

    async def begin(self) -> None:
        await self._run(
            f'ALTER DATABASE "{self.name}" WITH ALLOW_CONNECTIONS false',
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{self.name}' AND pid <> pg_backend_pid()",
        )

    async def end(self) -> None:
        await self._run(f'ALTER DATABASE "{self.name}" WITH ALLOW_CONNECTIONS true')


@pytest.fixture
async def pg(postgres_url: str) -> AsyncIterator[tuple[Sessions, Outage]]:
    """Sessions on a migrated database of the test's own, and the means to take it away."""
    url = await asyncio.to_thread(new_postgres_database, postgres_url)
    await asyncio.to_thread(upgrade, url)
    engine, outage = create_engine(url), Outage(url)
    try:
        yield session_factory(engine), outage
    finally:
        await outage.end()
        await engine.dispose()
        await outage.admin.dispose()


@contextlib.asynccontextmanager
async def running(recorder: UsageRecorder) -> AsyncIterator[UsageRecorder]:
    recorder.start()
    try:
        yield recorder
    finally:
        await recorder.close(retry_for=0)


async def test_no_event_is_lost_across_a_database_outage(pg: tuple[Sessions, Outage]) -> None:
    sessions, outage = pg
    events = random_events(random.Random(7), 700, ["t1", "t2"])
    async with running(UsageRecorder(sessions, interval=0.02, batch=50)) as recorder:
        for e in events[:100]:
            recorder.record(e)
        await eventually_stored(sessions, 100)

        await outage.begin()
        for e in events[100:400]:
            recorder.record(e)
        await eventually(lambda: recorder.failed_attempts >= 3, "no write was tried")
        assert (len(recorder), recorder.dropped) == (300, {})
        for e in events[400:]:
            recorder.record(e)
        await outage.end()

        await eventually_stored(sessions, 700)
        assert (len(recorder), recorder.failed_attempts, recorder.dropped) == (0, 0, {})
    stored_events = await assert_rollups_match_events(sessions)
    assert sorted(e.request_id for e in stored_events) == sorted(e.request_id for e in events)


async def test_past_its_bound_the_buffer_drops_new_events_and_says_so(
    pg: tuple[Sessions, Outage], caplog: pytest.LogCaptureFixture
) -> None:
    sessions, outage = pg
    events = random_events(random.Random(8), 30, ["t1"])
    async with running(UsageRecorder(sessions, interval=0.02, max_buffered=20)) as recorder:
        await outage.begin()
        for e in events:
            recorder.record(e)
        assert (len(recorder), recorder.dropped) == (20, {"buffer_full": 10})
        await outage.end()
        await eventually_stored(sessions, 20)
    stored_ids = {e.request_id for e in await assert_rollups_match_events(sessions)}
    assert stored_ids == {e.request_id for e in events[:20]}
    lost = [r for r in caplog.records if "DROPPED" in r.getMessage()]
    assert [r.levelname for r in lost] == ["ERROR"] * 10
    assert all(e.request_id in r.getMessage() for e, r in zip(events[20:], lost, strict=True))


def poison(dialect: str) -> UsageRecord:
    """An event the database refuses on its own: a count past 64 bits (SQLite), a model name
    longer than its column (PostgreSQL)."""
    event = random_events(random.Random(9), 1, ["t1"])[0]
    if dialect == "sqlite":
        return UsageRecord(**(vars(event) | {"request_id": "poison", "prompt_tokens": 2**70}))
    return UsageRecord(**(vars(event) | {"request_id": "poison", "model": "m" * 300}))


async def test_an_event_the_database_refuses_is_dropped_alone(
    sessions: Sessions, caplog: pytest.LogCaptureFixture
) -> None:
    async with sessions() as session:
        dialect = session.get_bind().dialect.name
    good = random_events(random.Random(10), 201, ["t1", "t2"])
    async with running(UsageRecorder(sessions, interval=0.02, batch=64)) as recorder:
        for e in [*good[:100], poison(dialect), *good[100:200]]:
            recorder.record(e)
        await eventually_stored(sessions, 200)
        assert recorder.dropped == {"refused": 1}
        recorder.record(good[200])  # the loop goes on
        await eventually_stored(sessions, 201)
    stored_ids = {e.request_id for e in await assert_rollups_match_events(sessions)}
    assert stored_ids == {e.request_id for e in good}
    (lost,) = [r for r in caplog.records if "DROPPED" in r.getMessage()]
    assert lost.levelname == "ERROR" and '"request_id": "poison"' in lost.getMessage()


async def test_closing_while_the_database_is_away_drops_loudly_instead_of_raising(
    pg: tuple[Sessions, Outage],
) -> None:
    sessions, outage = pg
    recorder = UsageRecorder(sessions, interval=0.02)
    recorder.start()
    await outage.begin()
    for e in random_events(random.Random(11), 5, ["t1"]):
        recorder.record(e)
    await recorder.close(retry_for=0.1)
    assert (len(recorder), recorder.dropped) == (0, {"shutdown": 5})


class CommitReplyLost:
    """A TCP relay to PostgreSQL that, once `armed` is set, lets the next COMMIT through to the
    server and breaks the connection when the server answers it: the transaction is committed,
    and the client never learns it. `fired` is set once that happened."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.armed = threading.Event()
        self.fired = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            commit_sent = threading.Event()
            args = (client, server, commit_sent)
            threading.Thread(target=self._up, args=args, daemon=True).start()
            threading.Thread(target=self._down, args=args, daemon=True).start()

    def _up(
        self, client: socket.socket, server: socket.socket, commit_sent: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if self.armed.is_set() and not self.fired.is_set() and b"COMMIT" in data:
                    commit_sent.set()
                server.sendall(data)
        _close(client, server)

    def _down(
        self, client: socket.socket, server: socket.socket, commit_sent: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                if commit_sent.is_set():  # the server has committed: its answer is lost
                    self.fired.set()
                    self.armed.clear()
                    break
                client.sendall(data)
        _close(client, server)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


@pytest.fixture
async def relayed(postgres_url: str) -> AsyncIterator[tuple[Sessions, CommitReplyLost]]:
    """Sessions on a migrated database of the test's own, reached through a CommitReplyLost."""
    url = await asyncio.to_thread(new_postgres_database, postgres_url)
    await asyncio.to_thread(upgrade, url)
    relay = CommitReplyLost(make_url(url).port or 5432)
    engine = create_engine(make_url(url).set(port=relay.port).render_as_string(hide_password=False))
    try:
        yield session_factory(engine), relay
    finally:
        await engine.dispose()
        relay.listener.close()


async def test_a_write_whose_commit_reply_is_lost_stores_each_event_once(
    relayed: tuple[Sessions, CommitReplyLost],
) -> None:
    """The write is taken as failed (the database may be unavailable) and the events are kept;
    written again, those the lost commit stored already are not stored, nor rolled up, again."""
    sessions, relay = relayed
    events = random_events(random.Random(12), 50, ["t1"])
    recorder = UsageRecorder(sessions)
    relay.armed.set()
    for e in events:
        recorder.record(e)
    with pytest.raises(UsageUnavailable):
        await recorder.flush()
    assert relay.fired.is_set() and len(recorder) == 50
    await recorder.flush()  # the database answers again: what was kept is written
    assert len(recorder) == 0

    assert await stored(sessions) == 50
    await assert_rollups_match_events(sessions)
    tokens = sum(e.prompt_tokens + e.completion_tokens for e in events)
    async with sessions() as session:
        daily = usage_daily.c.prompt_tokens + usage_daily.c.completion_tokens
        assert await session.scalar(select(func.sum(daily))) == tokens


async def test_an_event_recorded_after_close_is_dropped_loudly_not_kept_unwritten(
    sessions: Sessions, caplog: pytest.LogCaptureFixture
) -> None:
    """A request cut at shutdown is metered when its engine run ends, which can be after the
    recorder closed: its event waited in a buffer nothing would write again, silently lost."""
    events = random_events(random.Random(12), 2, ["t1"])
    async with running(UsageRecorder(sessions, interval=0.02)) as recorder:
        recorder.record(events[0])
    recorder.record(events[1])
    assert (len(recorder), recorder.dropped) == (0, {"shutdown": 1})
    assert [e.request_id for e in await assert_rollups_match_events(sessions)] == [
        events[0].request_id
    ]
    (lost,) = [r for r in caplog.records if "DROPPED" in r.getMessage()]
    assert lost.levelname == "ERROR" and events[1].request_id in lost.getMessage()
