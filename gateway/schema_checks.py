"""Structured-output schemas (`response_format`, forced tool calls) checked in child processes,
bounded in time and memory.

The grammar library bounds most of its work, but not all: deciding whether an `allOf` of
`pattern`s can match anything takes time exponential in their number (16 patterns, half a
second; 22, two minutes; 26, gigabytes and a crash of the library), and no limit of the library
caps it. A check therefore runs in a child process that is killed when it takes longer than
`CHECK_SECONDS` (the schema is refused, 400) and may not grow past `CHILD_MEMORY_BYTES`. Schemas
a client sends really compile in milliseconds.

A schema not checked before is checked before its prompt is tokenized, on a thread of its own,
tenants in turn (gateway.prompt_tokens), never on the event loop or a tokenizer thread, so that
slow schemas delay other tenants' new schemas (up to the bound a turn), never their prompts. One
child per such thread, started when first needed; a child ends with its parent, even in the
middle of a check. The bound counts from when a started child is sent the
schema, so a child's start-up never counts against a schema. Verdicts are kept by schema text
(timeouts included, not a child's death, which may be the machine's doing), so a schema that many
requests share is checked once, and a hostile one repeated costs nothing more.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import loramux
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.engine.structured.schema import MEMORY_ENV, READY

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
"""Longest a schema may take to check; longer, it is refused as too complex."""
CHILD_MEMORY_BYTES = 2 << 30
"""Address space a checking process may use (a fresh interpreter with the grammar library:
about a tenth of it)."""
VERDICTS = 1024
"""Verdicts kept, least recently used dropped first..."""
VERDICT_CHARS = 8_000_000
"""...and at most this many characters of schema text among them."""
STARTUP_SECONDS = 30.0
"""Longest a checking process may take to start (not counted in a check's bound)."""
TOO_COMPLEX = (
    "the JSON schema is too complex: checking it takes longer than {seconds:g} s (an allOf of "
    "several patterns is the usual cause)"
)


class SchemaChecks:
    """Bounded schema checks on up to `workers` child processes at once; safe from any thread."""

    def __init__(self, workers: int, seconds: float = CHECK_SECONDS) -> None:
        self.seconds = seconds
        self.workers = workers
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # started when first needed
        self._verdicts: OrderedDict[tuple[str | None, StructuredOutput], str | None] = OrderedDict()
        """By scope (a tenant) and schema: a verdict kept for one tenant answered another's
        check at once, which told it that someone had just sent the schema it guessed."""
        self._verdict_chars = 0
        self._lock = threading.Lock()
        self._closed = False
        self._children: set[_Child] = set()
        self.started = 0
        """Checking processes started so far (each refused timeout replaces one)."""

    def knows(self, spec: StructuredOutput, scope: str | None = None) -> bool:
        """Whether `spec`'s verdict is kept for `scope` (then `check` answers at once)."""
        with self._lock:
            return (scope, spec) in self._verdicts

    def check(self, spec: StructuredOutput, scope: str | None = None) -> None:
        """Raise StructuredOutputError when `spec` cannot be served (blocks: not on the loop).
        The verdict is kept for `scope` alone."""
        key = (scope, spec)
        with self._lock:
            known = key in self._verdicts
            verdict = self._verdicts.get(key)
            if known:
                self._verdicts.move_to_end(key)
        if not known:
            verdict, lasting = self._run(spec)
            if lasting:
                self._remember(key, verdict)
        if verdict is not None:
            raise StructuredOutputError(verdict)

    def _remember(self, key: tuple[str | None, StructuredOutput], verdict: str | None) -> None:
        spec = key[1]
        with self._lock:
            if key in self._verdicts:
                return
            self._verdicts[key] = verdict
            self._verdict_chars += len(spec.json_schema or "")
            while len(self._verdicts) > VERDICTS or self._verdict_chars > VERDICT_CHARS:
                (_, dropped), _ = self._verdicts.popitem(last=False)
                self._verdict_chars -= len(dropped.json_schema or "")

    def close(self) -> None:
        """Stop every child (a check under way then fails)."""
        with self._lock:
            self._closed = True
            children = list(self._children)
        for child in children:
            child.stop()

    def _run(self, spec: StructuredOutput) -> tuple[str | None, bool]:
        """The verdict, and whether it lasts (is the schema's whatever the load: not when the
        checking process died or could not start)."""
        child = self._idle.get()
        try:
            if child is None or not child.alive:
                child = self._start()
            verdict = child.ask(spec, self.seconds)
            if verdict is _TIMED_OUT:
                log.warning("a JSON schema took over %g s to check: refused", self.seconds)
                self._retire(child)
                child = None
                return TOO_COMPLEX.format(seconds=self.seconds), True
            return verdict, True
        except (OSError, EOFError):  # the child died (its memory bound) or was stopped
            if child is not None:
                self._retire(child)
            child = None
            return "the JSON schema cannot be compiled: checking it failed", False
        finally:
            self._idle.put(child)

    def _start(self) -> _Child:
        with self._lock:
            if self._closed:
                raise StructuredOutputError("the gateway is shutting down")
        child = _Child.start()  # outside the lock: verdicts known stay answered meanwhile
        with self._lock:
            self._children.add(child)
            self.started += 1
            closed = self._closed
        if closed:
            self._retire(child)
            raise StructuredOutputError("the gateway is shutting down")
        return child

    def _retire(self, child: _Child) -> None:
        child.stop()
        with self._lock:
            self._children.discard(child)


_TIMED_OUT = "\0timed out"


class _Child:
    """A checking process (engine.structured.schema run as a program): one JSON line in, the
    schema's spec; one JSON line out, its verdict."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @staticmethod
    def start() -> _Child:
        root = str(Path(loramux.__file__).resolve().parents[1])
        env = os.environ | {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        env[MEMORY_ENV] = str(CHILD_MEMORY_BYTES)
        command = [sys.executable, "-m", "loramux.engine.structured.schema"]
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True
        )
        child = _Child(process)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], STARTUP_SECONDS)
        if not ready or process.stdout.readline() != READY.encode():
            child.stop()
            raise OSError("the schema checking process did not start")
        return child

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, spec: StructuredOutput, seconds: float) -> str | None:
        """The child's verdict, or `_TIMED_OUT` (the child is then still busy: stop it).
        OSError or EOFError when the child died."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps([spec.kind, spec.json_schema]).encode() + b"\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], seconds)
        if not ready:
            return _TIMED_OUT
        line = stdout.readline()
        if not line:
            raise EOFError("the schema checking process ended")
        verdict: str | None = json.loads(line)
        return verdict

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
