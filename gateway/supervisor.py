"""The child processes of `loramux serve` (its private redis-server, its engine): kept running
while serve runs, and never left behind when it stops.

A child cannot outlive serve:
- each runs in a session and process group of its own, which `stop` signals as a whole (SIGTERM,
  then SIGKILL after STOP_SECONDS), so whatever it started goes too; being out of the terminal's
  group, a Ctrl-C reaches serve alone, which stops its children in order;
- serve stops its children when it stops for any reason: SIGTERM or SIGINT (gateway.server), an
  exception, or interpreter exit (atexit);
- on Linux each child asks the kernel to SIGKILL it when serve dies (PR_SET_PDEATHSIG): the only
  way that also covers SIGKILL of serve itself.

A child that exits while serve runs is restarted, after a backoff that doubles from
FIRST_BACKOFF to MAX_BACKOFF with each exit that follows a short run (one of at least
STABLE_SECONDS resets it). Its state — up or not, restarts, why it last exited, whether it keeps
failing — is what /health reports.

A child that is up but hung (stopped by SIGSTOP, deadlocked, swapping, an engine whose step has
stalled) exits never, so it is probed every LIVE_PROBE_SECONDS once ready: one that has not
answered its probe for HUNG_SECONDS is killed, and so restarted like any child that exited.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from loramux.gateway.setting_checks import StartError

log = logging.getLogger(__name__)

STOP_SECONDS = 10.0
"""How long a stopped child may take to exit after SIGTERM before it is killed."""
FIRST_BACKOFF, MAX_BACKOFF = 0.25, 30.0
"""Seconds before a restart: FIRST_BACKOFF after one short run, doubling up to MAX_BACKOFF."""
STABLE_SECONDS = 60.0
"""A run at least this long was healthy: the next exit restarts after FIRST_BACKOFF again."""
FAILING_EXITS = 5
"""A child that exited this many times in a row after short runs is failing: serve's own
liveness (/health) says so, so an orchestrator can restart the whole service."""
PROBE_SECONDS = 0.1
"""Interval of readiness probes while a child starts."""
LIVE_PROBE_SECONDS = 5.0
"""Interval of liveness probes (the readiness probe again) once a child is ready."""
PROBE_TIMEOUT_SECONDS = 5.0
"""A probe not answered within this counts as failed."""
HUNG_SECONDS = 60.0
"""A ready child whose probe has failed for this long is hung: it is killed and restarted."""

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


class ChildFailed(StartError):
    """A child exited, or did not become ready in time, on serve's first start: serve does not
    start (one line, saying where the child's own account is)."""


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    ready: Callable[[], Awaitable[bool]]
    """One readiness probe: True once the child serves. Exceptions count as not ready."""
    start_seconds: float
    """How long a start may take before the child is killed (and restarted)."""
    env: Mapping[str, str] | None = None
    """The child's environment; serve's own when None."""
    quiet: bool = False
    """Discard the child's stdout (it logs elsewhere)."""
    output: str = "its output is above"
    """Where the child says why it failed, for the one line of a ChildFailed."""
    pass_fds: tuple[int, ...] = ()
    """Descriptors the child inherits (a gateway worker's listening socket)."""
    hung_seconds: float = HUNG_SECONDS
    """How long a ready child may fail its probe before it is killed as hung."""


def spawn(argv: list[str] | tuple[str, ...], **popen: Any) -> subprocess.Popen[bytes]:
    """Start a process that cannot outlive this one: in a new session and process group, and
    on Linux killed by the kernel when this process dies.

    The kernel ties PR_SET_PDEATHSIG to the *thread* that forked: call this from a thread that
    lives as long as the process (serve spawns from its event loop, on the main thread)."""
    parent = os.getpid()

    def die_with_parent() -> None:  # runs in the child, between fork and exec
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent, **popen
    )


def stop_group(proc: subprocess.Popen[bytes], deadline: float) -> None:
    """SIGTERM the process group led by `proc`, then `reap_group`."""
    _killpg(proc.pid, signal.SIGTERM)
    reap_group(proc, deadline)


def reap_group(proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Wait until `proc` exited, SIGKILLing its group if it still runs at `deadline`
    (time.monotonic); then SIGKILL whatever it started and left behind in its group."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _killpg(proc.pid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    """The group's id is its leader's pid (start_new_session); the kernel keeps that id while
    any member lives, so this reaches members left behind by a leader just reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


class SupervisedChild:
    """One child process, restarted whenever it exits until `stop`."""

    def __init__(self, spec: ChildSpec):
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = False
        """Started and answered its readiness probe; False from the moment it exits."""
        self.restarts = 0
        self.last_exit: str | None = None
        self.short_runs = 0
        """Exits in a row after runs shorter than STABLE_SECONDS."""
        self._started_at = 0.0
        self._stopping = False
        self._signalled = False
        self._watch: asyncio.Task[None] | None = None
        """The supervising task (held here: the event loop keeps only a weak reference)."""

    @property
    def failing(self) -> bool:
        return self.short_runs >= FAILING_EXITS

    def report(self) -> dict[str, Any]:
        return {
            "up": self.up,
            "pid": self.proc.pid if self.proc is not None else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "failing": self.failing,
        }

    async def started(self) -> None:
        """Wait until the child spawned by `launch` is ready; ChildFailed if it exits or runs
        out of time first. From then on it is restarted whenever it exits."""
        await self._until_ready()
        if not self.up:
            assert self.proc is not None
            code = await asyncio.to_thread(self.proc.wait)
            raise ChildFailed(
                f"{self.spec.name} {describe_exit(code)} before it was ready ({self.spec.output})"
            )
        self._watch = asyncio.create_task(self._supervise(), name=f"supervise {self.spec.name}")

    def terminate(self) -> None:
        """Stop restarting the child and send its group SIGTERM (`stop` waits for it)."""
        if self._stopping:
            return
        self._stopping = True
        self.up = False
        # Only a child not reaped yet is signalled: a reaped one's id may belong to another.
        self._signalled = self.proc is not None and self.proc.returncode is None
        if self.proc is not None and self._signalled:
            _killpg(self.proc.pid, signal.SIGTERM)

    def send_signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the child's group, unless the child was reaped (its id may be
        another's by then)."""
        if self.proc is not None and self.proc.returncode is None:
            _killpg(self.proc.pid, sig)

    def stop(self, deadline: float) -> None:
        """`terminate`, then block until the child exited, killing its group at `deadline`
        (time.monotonic)."""
        self.terminate()
        if self.proc is not None and self._signalled:
            reap_group(self.proc, deadline)
            log.info("stopped %s (pid %d)", self.spec.name, self.proc.pid)

    async def _supervise(self) -> None:
        while True:
            assert self.proc is not None
            hung, code = await self._exit_or_hang()
            if self._stopping:
                return
            _killpg(self.proc.pid, signal.SIGKILL)  # what it started and left behind (GPU memory)
            self.up = False
            self.last_exit = hung or describe_exit(code)
            ran = time.monotonic() - self._started_at
            self.short_runs = 0 if ran >= STABLE_SECONDS else self.short_runs + 1
            log.error(
                "%s (pid %d) %s after %.1f s; restarting it in %.2f s",
                self.spec.name,
                self.proc.pid,
                self.last_exit,
                ran,
                self._backoff(),
            )
            if not await self._relaunch():
                return
            await self._until_ready()
            if self.up:
                self.restarts += 1
                log.warning("%s is back (pid %d)", self.spec.name, self.proc.pid)

    async def _exit_or_hang(self) -> tuple[str | None, int]:
        """Wait until the child exits, probing it meanwhile; one that has not answered for
        `hung_seconds` is killed. Returns why it was killed (None if it exited) and its exit
        status."""
        assert self.proc is not None
        exited = asyncio.ensure_future(asyncio.to_thread(self.proc.wait))
        answered, hung = time.monotonic(), None
        interval = min(LIVE_PROBE_SECONDS, self.spec.hung_seconds / 4)
        while not exited.done():
            await asyncio.wait({exited}, timeout=interval)
            if exited.done() or self._stopping or hung is not None:
                continue
            if await self._probe():
                answered = time.monotonic()
            elif (silent := time.monotonic() - answered) >= self.spec.hung_seconds:
                hung = f"stopped answering for {silent:.0f} s and was killed"
                log.error("%s (pid %d) %s", self.spec.name, self.proc.pid, hung)
                _killpg(self.proc.pid, signal.SIGKILL)
        return hung, exited.result()

    def _backoff(self) -> float:
        return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** max(0, self.short_runs - 1))

    async def _relaunch(self) -> bool:
        """After the backoff, spawn the child again; False when it is being stopped. A spawn
        that fails (no file descriptors or memory left, its program or the data directory
        removed) counts as a short run and is tried again after the next backoff: it ended the
        supervising task before, silently, and the child stayed down for good."""
        while True:
            await asyncio.sleep(self._backoff())
            if self._stopping:
                return False
            try:
                self.launch()
                return True
            except (OSError, subprocess.SubprocessError) as exc:
                self.short_runs += 1
                self.last_exit = f"could not be started: {exc}"
                log.error(
                    "%s could not be started (%s); trying again in %.2f s",
                    self.spec.name,
                    exc,
                    self._backoff(),
                )

    def launch(self) -> None:
        """Spawn the child process (not waiting for it to be ready)."""
        self.proc = spawn(
            self.spec.argv,
            env=self.spec.env,
            stdout=subprocess.DEVNULL if self.spec.quiet else None,
            pass_fds=self.spec.pass_fds,
        )
        self._started_at = time.monotonic()

    async def _until_ready(self) -> None:
        """Probe the child until it is ready (`up`), exits, or runs out of time (then it is
        killed; the watch loop sees the exit)."""
        assert self.proc is not None
        deadline = self._started_at + self.spec.start_seconds
        while self.proc.poll() is None and not self._stopping:
            if await self._probe():
                self.up = True
                log.info("%s is ready (pid %d)", self.spec.name, self.proc.pid)
                return
            if time.monotonic() > deadline:
                log.error(
                    "%s (pid %d) was not ready within %.0f s; killing it",
                    self.spec.name,
                    self.proc.pid,
                    self.spec.start_seconds,
                )
                _killpg(self.proc.pid, signal.SIGKILL)
                return
            await asyncio.sleep(PROBE_SECONDS)

    async def _probe(self) -> bool:
        try:
            return await asyncio.wait_for(self.spec.ready(), PROBE_TIMEOUT_SECONDS)
        except Exception:
            return False


class Supervisor:
    """The children of one serve process. As a context manager it stops them all on exit,
    whatever the reason, and at interpreter exit should that come first."""

    def __init__(self) -> None:
        self.children: list[SupervisedChild] = []

    def spawn(self, spec: ChildSpec) -> SupervisedChild:
        """Spawn a child now; `await child.started()` waits until it is ready."""
        child = SupervisedChild(spec)
        self.children.append(child)
        child.launch()
        return child

    @property
    def failing(self) -> bool:
        return any(c.failing for c in self.children)

    def report(self) -> dict[str, dict[str, Any]]:
        return {c.spec.name: c.report() for c in self.children}

    def stop(self, children: list[SupervisedChild], seconds: float) -> None:
        """SIGTERM `children` at once, wait up to `seconds` for them (then kill them), and
        forget them."""
        self.children = [c for c in self.children if c not in children]
        deadline = time.monotonic() + seconds
        for child in children:
            child.terminate()
        for child in children:
            child.stop(deadline)

    def stop_all(self) -> None:
        """SIGTERM every child at once, then wait for each (the last started first). Once."""
        children, self.children = self.children, []
        deadline = time.monotonic() + STOP_SECONDS
        for child in children:
            child.terminate()
        for child in reversed(children):
            child.stop(deadline)

    def __enter__(self) -> Supervisor:
        atexit.register(self.stop_all)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        atexit.unregister(self.stop_all)
        self.stop_all()
