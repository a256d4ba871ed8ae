"""`loramux serve` as a real subprocess for tests, and what /proc says about its children.

A test starts serve in a process group of its own and, whatever happens, kills that group and
every child serve was seen to start (they run in sessions of their own).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

START_SECONDS = 240.0
"""Serve imports torch twice (gateway and engine) and loads the model: slow on 2 busy cores."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll `condition` until it holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (command) "
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by init is not)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                found.append(int(entry.name))
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@dataclass
class Serve:
    proc: subprocess.Popen[bytes]
    url: str
    data_dir: Path
    log: IO[bytes]
    seen: dict[int, str] = field(default_factory=dict)
    """Every child of serve seen so far: pid → command line."""

    def children(self) -> dict[int, str]:
        """Serve's live children now, by pid, with their command lines."""
        now = {pid: command_line(pid) for pid in children_of(self.proc.pid)}
        self.seen |= now
        return now

    def child(self, name: str) -> int:
        """The pid of serve's one child whose command line names `name`."""
        [pid] = [pid for pid, cmd in self.children().items() if name in cmd]
        return pid

    def redis_pid(self) -> int:
        return int((self.data_dir / "redis" / "redis.pid").read_text())

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def serve(
    data_dir: Path, env: dict[str, str], *, wait: bool = True, args: tuple[str, ...] = ()
) -> Iterator[Serve]:
    """Start `loramux serve` on a free port and (with `wait`) wait until /ready; kill everything
    at the end."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log = (data_dir / "serve.log").open("wb")
    cmd = [sys.executable, "-m", "loramux.gateway.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd,
        env=os.environ | env | {"LORAMUX_DATA_DIR": str(data_dir)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    running = Serve(proc, f"http://127.0.0.1:{port}", data_dir, log)
    try:
        if wait:
            wait_for(lambda: _ready(running), START_SECONDS, "serve is ready")
            running.children()
        yield running
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for pid, cmd in running.seen.items():
            if alive(pid) and command_line(pid) == cmd:
                os.kill(pid, signal.SIGKILL)
        log.close()


def _ready(running: Serve) -> bool:
    assert running.proc.poll() is None, f"serve exited:\n{running.output()}"
    try:
        return httpx.get(f"{running.url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def refusal(env: dict[str, str], data_dir: Path, *args: str, port: int | None = None) -> str:
    """What `loramux serve` (on `port`, else a free one) says when it refuses to start: it exits
    1 within seconds with one line on stderr (the last; no traceback)."""
    port = free_port() if port is None else port
    run = subprocess.run(
        [sys.executable, "-m", "loramux.gateway.cli", "serve", "--port", str(port), *args],
        env=os.environ | {"LORAMUX_DATA_DIR": str(data_dir)} | env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("loramux serve: "), run.stderr[-2000:]
    return line
