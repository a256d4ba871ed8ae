"""A completion request's response-cache lookup starts before its prompt is tokenized: the cache
key is known from the request itself (a request without max_tokens keys on the rule that
derives it), so the first Redis round trip overlaps the tokenizer's work, and the lookup is
finished (and counted) once the request is admitted. A request refused meanwhile gives the
lookup up: it is neither counted nor answered from the cache."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.gateway.serve_process import wait_for
from tests.gateway.tenants import TenantKey, new_tenant
from tests.gateway.tokenizer_threads import tokenizer_threads_held


@contextlib.contextmanager
def redis_commands(url: str) -> Iterator[list[str]]:
    """Every command the Redis server at `url` runs until exit (its MONITOR lines)."""
    parts = urlsplit(url)
    seen: list[str] = []
    stop = threading.Event()
    with socket.create_connection((parts.hostname, parts.port), timeout=0.2) as conn:
        conn.sendall(b"MONITOR\r\n")
        buffer = b""
        while b"\r\n" not in buffer:
            buffer += conn.recv(4096)
        assert buffer.startswith(b"+OK"), buffer
        buffer = buffer.split(b"\r\n", 1)[1]

        def read() -> None:
            nonlocal buffer
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    buffer += conn.recv(65536)
                *lines, buffer = buffer.split(b"\r\n")
                seen.extend(line.decode(errors="replace") for line in lines)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield seen
        finally:
            stop.set()
            reader.join(5)


def _chat(tenant: TenantKey, **fields: Any) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "count the otters"}]}
    return body | {"temperature": 0} | fields, {"authorization": f"Bearer {tenant.key}"}


def _reads_of(commands: list[str], scope: str) -> list[str]:
    """The GETs of exact entries under `scope` among MONITOR lines."""
    return [c for c in commands if '"GET"' in c and f'"{scope}' in c and ":x:" in c]


@pytest.mark.parametrize("fields", [{"max_tokens": 4}, {}], ids=["max_tokens", "no max_tokens"])
def test_the_exact_entry_is_read_while_the_prompt_waits_for_a_tokenizer_thread(
    gateway: RunningServer, admin: httpx.Client, redis_url: str, fields: dict[str, Any]
) -> None:
    tenant = new_tenant(admin, "overlap")
    body, headers = _chat(tenant, **fields)
    first = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == 200, first.text
    assert first.headers["x-cache"] == "miss"
    scope = gateway.state.cache.keys.scope(tenant.tenant_id)
    with (
        httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client,
        redis_commands(redis_url) as commands,
        ThreadPoolExecutor(1) as pool,
    ):
        with tokenizer_threads_held(gateway):
            again = pool.submit(client.post, "/v1/chat/completions", json=body)
            wait_for(lambda: gateway.state.prompts.waiting() == 1, 30, "the prompt waits")
            wait_for(lambda: _reads_of(commands, scope), 30, "its exact entry is read")
            assert gateway.state.prompts.waiting() == 1, "read before it was tokenized"
        answer = again.result(timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-cache"] == "exact"
    assert answer.json()["choices"] == first.json()["choices"]
    assert len(_reads_of(commands, scope)) == 1, "the lookup used the read it began with"


def test_a_request_refused_after_its_lookup_began_is_neither_counted_nor_answered(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Admission refuses the request (the first one's tokens left too few of the key's
    per-minute limit) after the lookup's first round trip began, with the entry it would hit in
    the cache: 429, and the tenant's lookups and the lookups metric stay as they were."""
    tenant = new_tenant(admin, "overlap-refused")
    quota = admin.put(f"/admin/keys/{tenant.key_id}/quotas", json={"tpm": 25})
    assert quota.status_code == 200, quota.text
    body, headers = _chat(tenant, max_tokens=4)
    url = f"{gateway.url}/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["total_tokens"] > 25 // 2, "a second one is over the limit"
    stats = gateway.state.cache.tenant_stats(tenant.tenant_id)
    lookups = stats.lookups

    def lookups_metric() -> float:
        lines = httpx.get(f"{gateway.url}/metrics").text.splitlines()
        name = "loramux_response_cache_lookups_total"
        return sum(float(x.split()[-1]) for x in lines if x.startswith(name))

    before = lookups_metric()
    refused = httpx.post(url, json=body, headers=headers)
    assert refused.status_code == 429, refused.text
    assert "x-cache" not in refused.headers
    assert stats.lookups == lookups
    assert lookups_metric() == before


def test_a_prompt_refused_as_too_long_gives_its_begun_lookup_up(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Tokenizing refuses the prompt (400) while its lookup is under way: the lookup is not
    counted."""
    tenant = new_tenant(admin, "overlap-long")
    limit = gateway.state.prompts.max_prompt_chars
    assert limit is not None
    body, headers = _chat(tenant, max_tokens=4)
    body["messages"] = [{"role": "user", "content": "otter " * (limit // 6 + 10)}]
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert gateway.state.cache.tenant_stats(tenant.tenant_id).lookups == 0
