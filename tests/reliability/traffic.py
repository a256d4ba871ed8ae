"""Load for the reliability suite and the soak benchmark: a seeded mix of requests that end in
every way a client can end them, a client that records what it received, and a runner.

A request's `Plan` says how its client ends it:
- `complete`: reads the whole answer (streamed with `include_usage`, or one JSON object);
- `disconnect`: a stream whose client closes the socket after `after_chunks` content chunks
  (0: right after the response head);
- `cancel`: a non-streaming request whose task is cancelled after `cancel_after` seconds (the
  socket closes; the request may have finished by then, and then it simply completed);
- `bad`: a hostile or malformed request that must get a 4xx and change nothing.

Deterministic requests (temperature 0) come from a small pool and repeat, so the response cache
answers some of them; every other request samples (temperature > 0, no seed) and is never cached.
Only `complete` plans are deterministic: an answer the cache stores always comes from a request
whose client saw it finish.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Ending = Literal["complete", "disconnect", "cancel", "bad"]

OWN_ADAPTER = "assistant"
"""Every tenant owns an adapter of this name (a different one each): names resolve per tenant."""
SHARED_ADAPTER = "shared-helper"
TOPICS = """paging sorting hashing parsing caching batching routing hashing queues trees graphs
tokens kernels adapters tenants quotas budgets streams sockets threads""".split()  # noqa: SIM905


# -- who sends -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tenant:
    id: str
    key_id: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


# -- plans -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mix:
    """Shares of the request mix; what is left after them completes normally."""

    stream: float = 0.5
    deterministic: float = 0.35
    disconnect: float = 0.05
    cancel: float = 0.03
    bad: float = 0.02
    max_tokens: tuple[int, int] = (1, 6)
    """Range of max_tokens of a request read to its end."""
    cut_max_tokens: int = 48
    """max_tokens of a request its client leaves: long enough to be cut mid-generation."""
    pool: int = 12
    """Distinct deterministic requests, shared by the tenants (they repeat: exact cache hits)."""


@dataclass(frozen=True)
class Plan:
    index: int
    tenant: int
    ending: Ending
    stream: bool
    body: bytes
    messages_key: str
    """The user message (prompt tokens depend on it alone); "" for bad requests."""
    max_tokens: int
    deterministic: bool
    after_chunks: int = 0
    cancel_after: float = 0.0
    expect: int = 200
    """The status a `bad` request must get (any 4xx is accepted where this is 400)."""


def plan_requests(count: int | None, tenants: int, mix: Mix, seed: int) -> Iterator[Plan]:
    """`count` planned requests (endless when None), the same for the same seed."""
    rng = random.Random(seed)
    models = ["demo-model", OWN_ADAPTER, SHARED_ADAPTER]
    # One pool for every tenant: a response cache that mixed tenants up would answer one
    # tenant's first request for a pooled body with another tenant's answer.
    pool = [
        (rng.choice(models), _message(rng), rng.randint(*mix.max_tokens)) for _ in range(mix.pool)
    ]
    for i in itertools.count() if count is None else range(count):
        tenant = rng.randrange(tenants)
        roll = rng.random()
        if roll < mix.bad:
            bad_body, expect = rng.choice(BAD_BODIES)
            yield Plan(i, tenant, "bad", False, bad_body, "", 0, False, expect=expect)
            continue
        roll -= mix.bad
        ending: Ending = "complete"
        if roll < mix.disconnect:
            ending = "disconnect"
        elif roll < mix.disconnect + mix.cancel:
            ending = "cancel"
        stream = ending == "disconnect" or (ending == "complete" and rng.random() < mix.stream)
        deterministic = ending == "complete" and rng.random() < mix.deterministic
        if deterministic:
            model, message, max_tokens = rng.choice(pool)
            sampling: dict[str, Any] = {"temperature": 0}
        else:
            model, message = rng.choice(models), rng.choice(pool)[1]
            max_tokens = (
                rng.randint(*mix.max_tokens) if ending == "complete" else mix.cut_max_tokens
            )
            sampling = {"temperature": 0.8}
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "stream": stream,
            **sampling,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        yield Plan(
            i,
            tenant,
            ending,
            stream,
            json.dumps(body).encode(),
            message,
            max_tokens,
            deterministic,
            after_chunks=rng.randint(0, 3),
            cancel_after=rng.uniform(0.0, 0.3),
        )


def _message(rng: random.Random) -> str:
    words = rng.sample(TOPICS, rng.randint(2, 6))
    return f"Explain {' and '.join(words)} in one line."


def _bad(**changes: Any) -> bytes:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps(body | changes).encode()


BAD_BODIES: list[tuple[bytes, int]] = [
    (b'{"model": "demo-model", "messages": [', 400),
    (_bad(model="no-such-model"), 404),
    (_bad(model=f"tnt_someone/{OWN_ADAPTER}"), 404),
    (_bad(max_tokens=0), 400),
    (_bad(temperature=7), 400),
    (_bad(messages=[]), 400),
]


# -- the client --------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one client saw of its request."""

    plan: Plan
    tenant_id: str
    started: float
    ended: float = 0.0
    status: int | None = None
    """None when no response head arrived (a cancelled request)."""
    request_id: str | None = None
    cache: str | None = None
    body_sent: bool = False
    """The whole request reached the socket (a request cancelled before that never existed)."""
    content_chunks: int = 0
    text: str = ""
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    done: bool = False
    """A stream ended with `data: [DONE]`; a JSON answer was read whole."""
    error: dict[str, Any] | None = None
    """The error object of a refusal (a response head other than 200)."""
    stream_error: dict[str, Any] | None = None
    """An error event sent inside a stream."""
    received_all: bool = False
    """The client read the answer to its end (not disconnected, not cancelled)."""

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def billed_as_received(self) -> int:
        """What the answer's usage says the request cost: 0 for a cache hit (its usage shows
        the original counts, but a hit uses no tokens)."""
        if self.usage is None or self.cache in ("exact", "semantic"):
            return 0
        return self.usage["prompt_tokens"] + self.usage["completion_tokens"]


async def send(http: httpx.AsyncClient, tenant: Tenant, plan: Plan) -> Outcome:
    """Send one planned request and end it as the plan says."""
    outcome = Outcome(plan, tenant.id, time.monotonic())

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.complete":
            outcome.body_sent = True

    request = http.build_request(
        "POST",
        "/v1/chat/completions",
        content=plan.body,
        headers={**tenant.auth, "content-type": "application/json"},
        extensions={"trace": trace},
    )
    try:
        if plan.stream:
            await _read_stream(http, request, outcome)
        elif plan.ending == "cancel":
            task = asyncio.ensure_future(_read_whole(http, request, outcome))
            done, _ = await asyncio.wait({task}, timeout=plan.cancel_after)
            if not done:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:
            await _read_whole(http, request, outcome)
    finally:
        outcome.ended = time.monotonic()
    return outcome


async def _read_whole(http: httpx.AsyncClient, request: httpx.Request, o: Outcome) -> None:
    response = await http.send(request)
    _head(response, o)
    if response.status_code == 200:
        body = response.json()
        o.usage = body.get("usage")
        o.text = body["choices"][0]["message"]["content"] or ""
        o.finish_reason = body["choices"][0]["finish_reason"]
    else:
        o.error = _error_of(response)
    o.done = o.received_all = True


async def _read_stream(http: httpx.AsyncClient, request: httpx.Request, o: Outcome) -> None:
    response = await http.send(request, stream=True)
    try:
        _head(response, o)
        if response.status_code != 200:
            await response.aread()
            o.error = _error_of(response)
            o.received_all = True
            return
        leave = o.plan.ending == "disconnect"
        async for line in response.aiter_lines():
            if leave and o.content_chunks >= o.plan.after_chunks:
                return  # closing a response not read to its end closes the socket
            _event(line, o)
        o.received_all = True
    finally:
        await response.aclose()


def _head(response: httpx.Response, o: Outcome) -> None:
    o.status = response.status_code
    o.request_id = response.headers.get("x-request-id")
    o.cache = response.headers.get("x-cache")


def _error_of(response: httpx.Response) -> dict[str, Any] | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error if isinstance(error, dict) else None


def _event(line: str, o: Outcome) -> None:
    if not line.startswith("data: "):
        return
    data = line.removeprefix("data: ")
    if data == "[DONE]":
        o.done = True
        return
    event = json.loads(data)
    if "error" in event:
        o.stream_error = event["error"]
        return
    if event.get("usage"):
        o.usage = event["usage"]
    for choice in event.get("choices", []):
        content = choice["delta"].get("content")
        if content:
            o.content_chunks += 1
            o.text += content
        o.finish_reason = choice.get("finish_reason") or o.finish_reason


@dataclass
class Run:
    """Outcomes in the order requests ended, filled while the load runs."""

    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0


async def run_load(
    base_url: str,
    tenants: Sequence[Tenant],
    plans: Iterable[Plan],
    concurrency: int,
    run: Run | None = None,
    until: asyncio.Event | None = None,
    backoff: float = 0.0,
) -> Run:
    """Send the plans from `concurrency` workers (a finished request starts the next one) until
    they run out or `until` is set; outcomes go into `run` as requests end. A worker whose
    request was refused with a 5xx waits `backoff` seconds before its next, as clients do."""
    run = run if run is not None else Run()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    pending = iter(plans)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as http:

        async def worker() -> None:
            for plan in pending:
                outcome = await send(http, tenants[plan.tenant], plan)
                run.outcomes.append(outcome)
                if until is not None and until.is_set():
                    return
                if (outcome.status or 0) >= 500 or outcome.stream_error is not None:
                    await asyncio.sleep(backoff)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.seconds = time.monotonic() - started
    return run
