"""Structured-output schemas are checked in child processes bounded in time (gateway.schema_checks):
a schema whose check would run for minutes (an allOf of many patterns: the grammar library's
regex-emptiness check is exponential in their number, and none of its limits caps it) is refused
once the bound passes, the process checking it is replaced, and the gateway keeps serving other
tenants meanwhile. Hostile schemas found by attacking the gateway (2026-11-27)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import llguidance
import pytest

from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.engine.structured.schema import PANIC_ERROR, check_error
from loramux.gateway.schema_checks import SchemaChecks
from loramux.gateway.server import RunningServer
from tests.gateway.tenants import new_tenant

REPO = Path(__file__).parents[2]


def patterns_schema(n: int, first: str = "a") -> dict[str, object]:
    """A string that must match n `.*x.*` patterns at once: deciding whether any string can
    takes the grammar library time exponential in n (n = 22: about two minutes)."""
    return {
        "type": "string",
        "allOf": [{"pattern": f".*{chr(ord(first) + i)}.*"} for i in range(n)],
    }


def spec_of(schema: dict[str, object]) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True))


GOOD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_check_past_the_bound_is_refused_its_process_replaced_and_its_verdict_kept() -> None:
    checks = SchemaChecks(workers=1, seconds=0.5)
    try:
        checks.check(spec_of(GOOD))
        assert checks.started == 1
        with pytest.raises(StructuredOutputError, match="too complex"):
            checks.check(spec_of(patterns_schema(22)))
        checks.check(spec_of(GOOD | {"title": "another"}))  # a fresh process checks it
        assert checks.started == 2
        with pytest.raises(StructuredOutputError, match="too complex"):
            checks.check(spec_of(patterns_schema(22)))  # remembered: no process spent on it
        with pytest.raises(StructuredOutputError, match="does not exist"):
            checks.check(spec_of({"$ref": "#/nowhere"}))  # the library's own refusal
        assert checks.started == 2
    finally:
        checks.close()


def test_a_verdict_is_kept_for_its_tenant_alone() -> None:
    """Verdicts kept for one tenant answered another's check at once (no process spent), so a
    tenant could tell from the time its check took whether someone had just sent the schema it
    guessed. The other tenant's check is its own, run again."""
    checks = SchemaChecks(workers=1, seconds=0.5)
    try:
        with pytest.raises(StructuredOutputError, match="too complex"):
            checks.check(spec_of(patterns_schema(22)), "tenant-a")
        assert checks.started == 1 and checks.knows(spec_of(patterns_schema(22)), "tenant-a")
        assert not checks.knows(spec_of(patterns_schema(22)), "tenant-b")
        with pytest.raises(StructuredOutputError, match="too complex"):
            checks.check(spec_of(patterns_schema(22)), "tenant-b")  # checked again, for b
        assert checks.started == 2, "b's verdict was a's, answered at once"
    finally:
        checks.close()


def test_a_checking_process_ends_with_its_parent_even_in_the_middle_of_a_check() -> None:
    """The gateway worker killed while a hostile schema is being checked: the checking process
    does not go on for minutes (or forever) on its own."""
    script = f"""
import json, os, sys, threading, time
from loramux.engine.structured import StructuredOutput
from loramux.gateway.schema_checks import SchemaChecks
checks = SchemaChecks(workers=1, seconds=600)
spec = StructuredOutput("json_schema", json.dumps({json.dumps(patterns_schema(24))}))
threading.Thread(target=checks.check, args=(spec,), daemon=True).start()
while not checks._children:
    time.sleep(0.01)
(child,) = checks._children
print(child.process.pid, flush=True)

def cpu_seconds(pid):
    fields = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

deadline = time.monotonic() + 30  # until the child is well into the check
while cpu_seconds(child.process.pid) < 0.5 and time.monotonic() < deadline:
    time.sleep(0.01)
os._exit(0)
"""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    parent = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    assert parent.returncode == 0, parent.stderr
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), "the checking process outlived its parent"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_a_panic_of_the_grammar_library_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyo3 raises a Rust panic as PanicException, a BaseException: an `except Exception` misses
    it and the request ended as a bare 500. (A real one needs minutes of a hostile schema.)"""
    panic = type("PanicException", (BaseException,), {})

    def validate(*args: object, **kwargs: object) -> str:
        raise panic("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", validate)
    assert check_error.__wrapped__(spec_of(GOOD)) == PANIC_ERROR


def test_a_hostile_schema_is_refused_while_other_tenants_are_served(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Tenant A's schema (response_format, or a forced tool's parameters) is checked in a child
    process, on the schema thread in A's turn: not on the event loop nor a tokenizer thread,
    which served tenant B's request meanwhile. Each of A's requests gets a 400 naming the
    field."""
    a, b = new_tenant(admin, "schemer"), new_tenant(admin, "bystander")
    base = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
    base |= {"max_tokens": 2}
    hostile = patterns_schema(22, first="b")
    formats = {
        "response_format": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": hostile},
            }
        },
        "tools": {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": "required",
        },
    }
    finished: list[str] = []

    def post(key: str, body: dict[str, object], name: str) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}", "cache-control": "no-store"}
        answer = httpx.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=120
        )
        finished.append(name)
        return answer

    parameters = {"type": "object", "properties": {"x": patterns_schema(22, first="c")}}
    formats["tools"]["tools"][0]["function"]["parameters"] = parameters  # type: ignore[index]
    checks = gateway.state.prompts.schemas
    for param, extra in formats.items():
        finished.clear()
        with ThreadPoolExecutor(1) as pool:
            refused = pool.submit(post, a.key, base | extra, "a")
            _wait_until_checking(checks)
            served = post(b.key, base, "b")
            assert served.status_code == 200, served.text
            answer = refused.result(timeout=120)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and "too complex" in error["message"], error
        assert finished == ["b", "a"]


def _wait_until_checking(checks: SchemaChecks) -> None:
    """Until a checking process holds a schema (the queue of idle ones is short by one)."""
    deadline = time.monotonic() + 30
    while checks._idle.qsize() == checks.workers and time.monotonic() < deadline:
        time.sleep(0.005)
    assert checks._idle.qsize() < checks.workers, "no check started"


def test_a_childs_death_is_not_remembered_and_verdicts_are_bounded_by_their_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check whose process died (its memory bound, or the machine) refuses that request only:
    the schema is checked again next time. Verdicts kept are bounded by their schemas' text."""
    checks = SchemaChecks(workers=1, seconds=600)
    try:
        slow = spec_of(patterns_schema(24))
        with ThreadPoolExecutor(1) as pool:
            checking = pool.submit(checks.check, slow)
            deadline = time.monotonic() + 30
            while not checks._children and time.monotonic() < deadline:
                time.sleep(0.005)
            (child,) = checks._children
            child.process.kill()
            with pytest.raises(StructuredOutputError, match="checking it failed"):
                checking.result(timeout=60)
        assert not checks.knows(slow)
        monkeypatch.setattr("loramux.gateway.schema_checks.VERDICT_CHARS", 400)
        specs = [spec_of(GOOD | {"title": "x" * 100 + str(i)}) for i in range(4)]
        for spec in specs:
            checks.check(spec)
        assert [spec for _, spec in checks._verdicts] == specs[-2:]
        assert checks._verdict_chars == sum(len(s.json_schema or "") for s in specs[-2:])
    finally:
        checks.close()
