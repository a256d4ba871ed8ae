"""Every adapter kind the engine serves goes through the admin API and the OpenAI API: a DoRA
adapter, LoRA on the token embedding, and a saved lm_head each upload (201) and answer chat
completions from their own weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from loramux.adapters.demo import build_demo_adapters
from loramux.gateway.server import RunningServer
from tests.adapters.peft_adapters import make_peft_adapter
from tests.gateway.tenants import new_tenant, upload_adapter

PROMPT = [{"role": "user", "content": "Say something about adapters"}]


@pytest.fixture(scope="module")
def kinds(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")

    def demo() -> Any:
        return LlamaForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)

    return {
        "dora": build_demo_adapters(demo_model_dir, root / "dora", 1, dora=True)[0],
        "embedding": make_peft_adapter(
            root / "embedding", model=demo(), target_modules=["embed_tokens", "q_proj"]
        ),
        "saved-head": make_peft_adapter(
            root / "head", model=demo(), target_modules=["v_proj"], modules_to_save=["lm_head"]
        ),
    }


def test_each_kind_uploads_and_answers(
    gateway: RunningServer, admin: httpx.Client, kinds: dict[str, Path]
) -> None:
    tenant = new_tenant(admin, "kinds")
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
    ).with_options(default_headers={"cache-control": "no-store"})
    stats = gateway.state.engine.engine.adapter_stats
    for name, folder in kinds.items():
        digest = upload_adapter(admin, tenant.tenant_id, name, folder)["digest"]
        out = client.chat.completions.create(model=name, messages=PROMPT, max_tokens=6)  # type: ignore[arg-type]
        assert out.model == name and out.usage is not None
        assert out.usage.completion_tokens > 0
        assert stats()[digest].tokens >= out.usage.completion_tokens, name
