"""The supervisor of serve's child processes, on real (small) processes: failed starts, restarts,
a child that keeps dying, and stopping a child together with what it started."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loramux.gateway.supervisor import FAILING_EXITS, ChildFailed, ChildSpec, Supervisor
from tests.gateway.serve_process import alive


async def _ready() -> bool:
    return True


async def _never() -> bool:
    return False


def _spec(
    script: str, ready: Callable[[], Awaitable[bool]] = _ready, start_seconds: float = 30
) -> ChildSpec:
    return ChildSpec("sh", ("sh", "-c", script), ready, start_seconds)


async def _until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    with Supervisor() as children:
        yield children


async def test_a_child_that_exits_before_it_is_ready_fails_the_start(
    supervisor: Supervisor,
) -> None:
    child = supervisor.spawn(_spec("exit 3", _never))
    with pytest.raises(ChildFailed, match="sh exited with status 3 before it was ready"):
        await child.started()


async def test_a_child_not_ready_in_time_is_killed(supervisor: Supervisor) -> None:
    child = supervisor.spawn(_spec("exec sleep 60", _never, start_seconds=0.2))
    with pytest.raises(ChildFailed, match="was killed by SIGKILL before it was ready"):
        await child.started()
    assert child.proc is not None and not alive(child.proc.pid)


async def test_a_child_that_dies_is_restarted_until_stopped(supervisor: Supervisor) -> None:
    child = supervisor.spawn(_spec("exec sleep 60"))
    await child.started()
    assert child.proc is not None
    first = child.proc.pid
    os.kill(first, signal.SIGKILL)
    await _until(lambda: child.restarts == 1 and child.up, 30, "the child is back")
    report = supervisor.report()["sh"]
    assert report["pid"] != first and alive(report["pid"])
    assert report["last_exit"] == "was killed by SIGKILL" and not report["failing"]

    supervisor.stop_all()
    assert not alive(report["pid"])


async def test_stopping_a_child_stops_what_it_started(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    pid_file = tmp_path / "grandchild"

    async def grandchild_started() -> bool:
        return pid_file.is_file() and pid_file.read_text().strip() != ""

    child = supervisor.spawn(_spec(f"sleep 300 & echo $! > {pid_file}; wait", grandchild_started))
    await child.started()
    grandchild = int(pid_file.read_text())
    assert alive(grandchild)
    supervisor.stop_all()
    await _until(lambda: not alive(grandchild), 10, "the grandchild is gone")


async def test_a_child_that_keeps_dying_soon_after_its_start_is_failing(
    supervisor: Supervisor,
) -> None:
    child = supervisor.spawn(_spec("sleep 0.1; exit 1"))
    await child.started()
    await _until(lambda: child.failing, 60, f"it exited {FAILING_EXITS} times")
    assert supervisor.failing and supervisor.report()["sh"]["failing"]
    assert child.last_exit == "exited with status 1"


async def test_a_restart_that_cannot_spawn_the_child_is_retried_until_it_can(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    """A spawn that raised (no file descriptors left, the program or data directory removed)
    ended the supervising task quietly: the child was never restarted, /health degraded for
    good. Here the child's program is gone when it dies, and back a moment later."""
    program = tmp_path / "child"
    program.write_text("#!/bin/sh\nexec sleep 60\n")
    program.chmod(0o755)
    child = supervisor.spawn(ChildSpec("sh", (str(program),), _ready, 30))
    await child.started()
    assert child.proc is not None
    hidden = program.rename(tmp_path / "hidden")
    os.kill(child.proc.pid, signal.SIGKILL)
    await _until(
        lambda: (child.last_exit or "").startswith("could not be started"), 30, "a spawn failed"
    )
    hidden.rename(program)
    await _until(lambda: child.restarts == 1 and child.up, 30, "the child is back")
    assert child.proc is not None and alive(child.proc.pid)


async def test_a_child_that_stops_answering_is_killed_and_restarted(
    supervisor: Supervisor, unused_tcp_port: int
) -> None:
    """A hung child (here stopped by SIGSTOP) never exits, so it was never restarted: serve's
    engine or redis-server could hang for good while /health said it was up."""
    url = f"http://127.0.0.1:{unused_tcp_port}/"

    async def answers() -> bool:
        async with httpx.AsyncClient(timeout=0.5) as client:
            return (await client.get(url)).status_code == 200

    server = (sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(unused_tcp_port))
    child = supervisor.spawn(ChildSpec("http", server, answers, 30, hung_seconds=1.0))
    await child.started()
    assert child.proc is not None
    first = child.proc.pid
    os.kill(first, signal.SIGSTOP)
    await _until(lambda: child.restarts == 1 and child.up, 30, "the hung child is back")
    assert not alive(first) and child.proc.pid != first
    assert child.last_exit is not None and child.last_exit.startswith("stopped answering for")
    assert await answers()
