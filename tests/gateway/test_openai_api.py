"""The OpenAI-compatible API through the official `openai` client, against a running gateway."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from loramux.gateway.server import RunningServer
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter

MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


def client(gateway: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tenant(admin_module: httpx.Client) -> TenantKey:
    return new_tenant(admin_module, "openai")


@pytest.fixture(scope="module")
def admin_module(gateway: RunningServer, admin_token: str) -> Any:
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}, timeout=120
    ) as c:
        yield c


def test_chat_streaming_and_not_agree(gateway: RunningServer, tenant: TenantKey) -> None:
    c = client(gateway, tenant.key)
    whole = c.chat.completions.create(
        model="demo-model", messages=MESSAGES, max_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    assert whole.object == "chat.completion" and whole.model == "demo-model"
    assert (
        whole.usage is not None
        and whole.usage.completion_tokens == len(whole.choices) * 0 + whole.usage.completion_tokens
    )
    chunks = list(
        c.chat.completions.create(
            model="demo-model",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[
        0
    ].finish_reason


def test_completions_and_models(gateway: RunningServer, tenant: TenantKey) -> None:
    c = client(gateway, tenant.key)
    out = c.completions.create(
        model="demo-model", prompt="def add(a, b):", max_tokens=8, temperature=0
    )
    assert out.object == "text_completion" and out.choices[0].text
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="demo-model", prompt="def add(a, b):", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == out.choices[0].text
    assert "demo-model" in [m.id for m in c.models.list()]


def test_errors_arrive_as_the_clients_exception_classes(
    gateway: RunningServer, tenant: TenantKey, admin_module: httpx.Client
) -> None:
    good = client(gateway, tenant.key)
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "lmx-AAAAAAAAAAAA." + "x" * 43).models.list()
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "not-a-key").models.list()
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="no-such-adapter", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        good.chat.completions.create(model="demo-model", messages=MESSAGES, n=17)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        good.chat.completions.create(model="demo-model", messages=MESSAGES, max_tokens=100_000)  # type: ignore[arg-type]
    _, limited = new_key(admin_module, tenant.tenant_id, allowed_models=["some-other-model"])
    with pytest.raises(openai.PermissionDeniedError):
        client(gateway, limited).chat.completions.create(model="demo-model", messages=MESSAGES)  # type: ignore[arg-type]


def test_adapter_output_equals_peft(
    gateway: RunningServer,
    tenant: TenantKey,
    admin_module: httpx.Client,
    demo_model_dir: Path,
    demo_adapter_dirs: list[Path],
) -> None:
    folder = demo_adapter_dirs[6]
    upload_adapter(admin_module, tenant.tenant_id, "support-bot", folder)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, folder).eval()
    with torch.inference_mode():
        out = peft.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
        )
    expected = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)

    c = client(gateway, tenant.key)
    reply = c.chat.completions.create(
        model="support-bot", messages=MESSAGES, max_tokens=20, temperature=0
    )  # type: ignore[arg-type]
    assert reply.choices[0].message.content == expected
    assert reply.model == "support-bot"
    owned = c.chat.completions.create(
        model=f"{tenant.tenant_id}/support-bot", messages=MESSAGES, max_tokens=20, temperature=0
    )  # type: ignore[arg-type]
    assert owned.choices[0].message.content == expected


def test_client_disconnect_aborts_the_engine_sequence(
    gateway: RunningServer, tenant: TenantKey
) -> None:
    body = {
        "model": "demo-model",
        "messages": MESSAGES,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {tenant.key}"}
    before = gateway.run(gateway.state.engine.stats())[0]  # the session's engine: counts so far
    with httpx.stream(
        "POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = gateway.run(gateway.state.engine.stats())[0]
        if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the aborted request kept running: {stats}")
    assert stats.aborted > before.aborted
    assert stats.generated_tokens - before.generated_tokens < 400
