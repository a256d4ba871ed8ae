"""Engine fixtures: a transformers reference model and engines over the demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loramux.engine.config import EngineConfig
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput


@pytest.fixture(scope="session")
def hf_model(demo_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(demo_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(demo_model_dir)


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`, ending at EOS (included) or max_new_tokens.

    (No `min_new_tokens`: transformers enforces it by masking EOS logits, which is not greedy.)"""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"model": model_dir, "max_model_len": 512, "num_kv_blocks": 256}
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def run_to_completion(
    engine: LLMEngine, requests: list[EngineRequest]
) -> dict[str, list[RequestOutput]]:
    """Add every request, step until idle; the deltas of each request in order."""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs
