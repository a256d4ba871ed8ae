"""Batches mixing adapters of several kinds and base-model requests, run through the engine and
compared with PEFT one request at a time (PEFT's mixed-adapter batches refuse DoRA and cannot
hold lm_head LoRA beside a saved lm_head)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams

MAX_TOKENS = 12


def random_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(rng.randrange(5, 40))]


def reference_greedy(model: Any, adapter: str | None, prompt: list[int]) -> list[int]:
    """MAX_TOKENS greedy tokens from PEFT with `adapter` active (None: adapters disabled)."""
    inputs = {
        "input_ids": torch.tensor([prompt]),
        "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
        "max_new_tokens": MAX_TOKENS,
        "do_sample": False,
    }
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(**inputs)
        else:
            model.set_adapter(adapter)
            out = model.generate(**inputs)
    return out[0, len(prompt) :].tolist()


def mixed_requests(engine: LLMEngine, folders: dict[str, Path], seed: int) -> list[EngineRequest]:
    """Register every adapter; two requests per adapter, ids `<name>/<k>`, and two base-model
    requests `base/<k>`."""
    digests = {name: engine.register_adapter(folder) for name, folder in folders.items()}
    requests = [
        EngineRequest(
            f"{name}/{k}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=random_prompt(seed + 10 * i + k),
            adapter=digest,
        )
        for i, (name, digest) in enumerate(digests.items())
        for k in range(2)
    ]
    requests += [
        EngineRequest(
            f"base/{k}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=random_prompt(seed + 900 + k),
        )
        for k in range(2)
    ]
    return requests


def run_tokens(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Add every request, step until idle; each request's tokens."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return tokens


def assert_equal_to_reference(
    tokens: dict[str, list[int]], requests: list[EngineRequest], model_for: Callable[[str], Any]
) -> None:
    """Every `mixed_requests` request's tokens equal PEFT's (`model_for(name)` holds `name`)."""
    for r in requests:
        name = r.request_id.split("/")[0]
        adapter = None if name == "base" else name
        expected = reference_greedy(model_for(name), adapter, r.prompt_token_ids or [])
        assert tokens[r.request_id] == expected, r.request_id
