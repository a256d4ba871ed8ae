"""One tenant flooding the gateway's tokenizer threads does not hold up another tenant's prompt:
the threads take tenants in turn (engine.fair_pool). The flood's prompts are each just under
the characters the context could hold and far over its tokens, so each is tokenized
(milliseconds of a tokenizer thread) before it is refused: the costliest request a tenant can
send without reaching the engine, and one its rate limit does not stop (admission comes after
tokenizing)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from loramux.engine.errors import PromptTooLongError
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.db import UsageEvent
from loramux.gateway.errors import RateLimited
from loramux.gateway.prompt_tokens import TOKENIZER_THREADS, PromptTokens
from loramux.gateway.server import RunningServer
from tests.gateway.serve_process import wait_for
from tests.gateway.tenants import new_tenant
from tests.gateway.tokenizer_threads import tokenizer_threads_held

FLOOD = 20
LEAVERS = 6


def _chat(content: str) -> EngineRequest:
    messages = [{"role": "user", "content": content}]
    return EngineRequest("r", SamplingParams(max_tokens=8), messages=messages)


def _flood_prompt(limit: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["otter", "harbour", "bridge", "stone", "quiet", "river", "north", "count"]
    return " ".join(rng.choice(words) for _ in range(limit // 4))[: limit - 64]


async def test_a_tenants_flood_of_prompts_waits_behind_itself_not_before_other_tenants(
    demo_model_dir: Path,
) -> None:
    prompts = PromptTokens(demo_model_dir, vocab_size=4096, max_model_len=512)
    try:
        limit = prompts.max_prompt_chars
        assert limit is not None
        finished: list[str] = []

        def track(name: str, job: asyncio.Future[list[int]]) -> asyncio.Future[list[int]]:
            job.add_done_callback(lambda _: finished.append(name))
            return job

        flood = [
            track(f"flood{i}", asyncio.ensure_future(prompts.prompt_ids(_chat(p), "flooder")))
            for i, p in enumerate(_flood_prompt(limit, seed) for seed in range(FLOOD))
        ]
        await asyncio.sleep(0)  # the flood is queued
        quiet = track("quiet", asyncio.ensure_future(prompts.prompt_ids(_chat("hi"), "quiet")))
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        assert await quiet
        assert all(isinstance(o, PromptTooLongError) for o in outcomes), outcomes
        # In one queue for all, the quiet prompt was tokenized last; in turns, right after the
        # flood's prompt that was next when it came (each thread was busy with one).
        assert finished.index("quiet") <= 3, finished
    finally:
        prompts.close()


async def test_a_tenant_with_its_bound_of_prompts_waiting_is_refused_another_until_one_starts(
    demo_model_dir: Path,
) -> None:
    """429 `rate_limit_exceeded` at once, untokenized; another tenant's prompt is served."""
    bound = 2
    prompts = PromptTokens(demo_model_dir, 4096, 512, max_waiting_per_tenant=bound)
    try:
        limit = prompts.max_prompt_chars
        assert limit is not None
        # Enqueued in one turn of the loop: however many the threads took meanwhile, the last
        # finds `bound` waiting.
        flood = [prompts.prompt_ids(_chat(_flood_prompt(limit, i)), "flooder") for i in range(5)]
        outcomes = await asyncio.gather(*flood, return_exceptions=True)
        refused = outcomes[TOKENIZER_THREADS + bound :]
        assert refused and all(isinstance(o, RateLimited) for o in refused), outcomes
        assert refused[0].status == 429 and refused[0].refusal == "backlog"
        assert refused[0].headers == {"retry-after": "1"}
        assert await prompts.prompt_ids(_chat("hi"), "quiet")
        assert await prompts.prompt_ids(_chat("hi"), "flooder")  # room again
    finally:
        prompts.close()


def test_a_prompt_whose_client_left_before_its_turn_is_never_tokenized(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """Both tokenizer threads held busy (real jobs on the gateway's own pool), a tenant's
    prompts queue up; their clients close their connections; the prompts leave the queue
    untokenized and each request is recorded as the client leaving (499), not as tokenized
    and refused for its length (400)."""
    tenant = new_tenant(admin, "leaver")
    prompts = gateway.state.prompts
    limit = prompts.max_prompt_chars
    assert limit is not None
    content = _flood_prompt(limit, 1)
    body = {"model": "demo-model", "messages": [{"role": "user", "content": content}]}
    raw = json.dumps(body | {"max_tokens": 4}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        + f"authorization: Bearer {tenant.key}\r\n".encode()
        + b"content-type: application/json\r\ncache-control: no-store\r\n"
        + f"content-length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    with tokenizer_threads_held(gateway):
        port = int(gateway.url.rsplit(":", 1)[1])
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(LEAVERS)]
        for client in clients:
            client.sendall(request)
        wait_for(lambda: prompts.waiting() == LEAVERS, 30, "every prompt waits for a thread")
        for client in clients:
            client.close()
        wait_for(lambda: prompts.waiting() == 0, 30, "the prompts of the clients that left go")

    def recorded() -> list[UsageEvent]:
        async def read() -> list[UsageEvent]:
            await gateway.state.usage.flush()
            async with gateway.state.sessions() as session:
                query = select(UsageEvent).where(UsageEvent.tenant_id == tenant.tenant_id)
                return list(await session.scalars(query))

        events: list[UsageEvent] = gateway.run(read())
        return events

    wait_for(lambda: len(recorded()) == LEAVERS, 30, "every request is recorded")
    assert [e.status for e in recorded()] == [499] * LEAVERS


def test_a_backlog_refusal_is_counted_as_one_in_usage_and_metrics(
    gateway: RunningServer, admin: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant whose bound of prompts already waits gets 429 `backlog`: the usage API counts
    it under `backlog`, not as a requests-per-minute refusal, and so does the refusals metric;
    the waiting prompt is then served."""
    tenant = new_tenant(admin, "backlogged")
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}
    body |= {"max_tokens": 2}
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}

    def refusals_metric() -> float:
        text = httpx.get(f"{gateway.url}/metrics").text
        line = 'loramux_quota_refusals_total{reason="backlog"}'
        return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

    before = refusals_metric()
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client:
        # The pool is the outer one: its exit waits for the waiting prompt, which needs the
        # tokenizer threads back (the other order waited out the holders' 60 s).
        with ThreadPoolExecutor(1) as pool, tokenizer_threads_held(gateway):
            monkeypatch.setattr(gateway.state.prompts._pool, "max_waiting", 1)
            waiting = pool.submit(client.post, "/v1/chat/completions", json=body)
            wait_for(lambda: gateway.state.prompts.waiting() == 1, 30, "one prompt waits")
            refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "1"
        assert waiting.result(timeout=60).status_code == 200
    assert refusals_metric() == before + 1

    def rows() -> list[dict[str, Any]]:
        gateway.run(gateway.state.usage.flush())
        params = {"tenant": tenant.tenant_id, "group_by": "key"}
        got = admin.get("/admin/usage", params=params)
        assert got.status_code == 200, got.text
        return list(got.json()["rows"])

    wait_for(lambda: sum(r["requests"] for r in rows()) == 2, 30, "both requests are recorded")
    (row,) = rows()
    assert row["refusals"] == {
        "requests": 0,
        "tokens": 0,
        "concurrency": 0,
        "budget": 0,
        "backlog": 1,
    }
