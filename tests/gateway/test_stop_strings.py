"""Stop strings across the channel: the engine streams token ids, the gateway makes the text,
ends it before the stop string and aborts the engine's sequence (seen in the engine's stats)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.outputs import RequestOutput
from loramux.engine.sequence import FinishReason
from loramux.engine.service.runner import RunningEngineService
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.openai.generation import ChoiceRun
from loramux.gateway.server import RunningServer
from tests.engine.test_detokenizer import _lead_byte
from tests.gateway.servers import ENGINE_TOKEN, engine_service, gateway_server
from tests.gateway.tenants import TenantKey, new_tenant

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def split(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, redis_url: str
) -> Iterator[tuple[RunningServer, RunningEngineService, TenantKey]]:
    with (
        engine_service(demo_model_dir, tmp_path_factory.mktemp("adapters")) as service,
        gateway_server(
            demo_model_dir,
            tmp_path_factory.mktemp("data"),
            redis_url,
            client=lambda _: RemoteEngineClient([service.url], ENGINE_TOKEN),
        ) as gw,
    ):
        token = gw.state.admin.mint("test-admin", ttl_seconds=600)
        with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {token}"}) as a:
            tenant = new_tenant(a, "stops")
        yield gw, service, tenant


def _chat(gw: RunningServer, tenant: TenantKey, **extra: Any) -> httpx.Response:
    body = {
        "model": gw.state.model_name,
        "messages": [{"role": "user", "content": "Write a long story about a compiler."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    } | extra
    headers = {"authorization": f"Bearer {tenant.key}", "cache-control": "no-store"}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _idle_stats(service: RunningEngineService) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = service.engine.stats()
        if stats.running == stats.waiting == 0:
            return stats
    raise AssertionError(f"the engine never went idle: {stats}")


@pytest.mark.parametrize("stream", [False, True])
def test_text_ends_before_the_stop_string_and_the_engine_sequence_is_aborted(
    split: tuple[RunningServer, RunningEngineService, TenantKey], stream: bool
) -> None:
    gw, service, tenant = split
    free = _chat(gw, tenant)
    assert free.status_code == 200, free.text
    full = free.json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    before = _idle_stats(service)

    if stream:
        body = {"stop": [stop], "stream": True, "stream_options": {"include_usage": True}}
        response = _chat(gw, tenant, **body)
        chunks = [
            json.loads(line[6:])
            for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        usage = chunks[-1]["usage"]
    else:
        answer = _chat(gw, tenant, stop=[stop]).json()
        text = answer["choices"][0]["message"]["content"]
        finish, usage = answer["choices"][0]["finish_reason"], answer["usage"]

    assert text == full[: full.index(stop)]
    assert finish == "stop"
    assert usage["completion_tokens"] < MAX_TOKENS
    after = _idle_stats(service)
    assert after.aborted == before.aborted + 1
    assert after.kv_blocks_used == 0


def test_a_stop_string_completed_by_the_held_bytes_at_the_end_stops_the_choice(
    demo_model_dir: Path,
) -> None:
    """An output that ends on a lone lead byte shows it as U+FFFD at the end (flush), which can
    complete a stop string: the text ends before it and the choice finishes with `stop`. It
    finished with `length`, its stop unrecorded (found by attacking the fixes)."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = [*tokenizer.encode("ab"), _lead_byte(tokenizer)]
    run = ChoiceRun(0, IncrementalDetokenizer(tokenizer, stop=("\ufffd",)))
    delta = run.take(RequestOutput("r", ids, FinishReason.LENGTH))
    assert delta is not None and delta.text == "ab"
    assert (delta.finish_reason, run.stopped_at) == (FinishReason.STOP, len(ids))
