"""The engine's greedy output equals transformers' greedy generate, token for token, under
continuous batching, chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.engine.conftest import hf_greedy, make_engine, run_to_completion


def _prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """Prompts of varied lengths (3 to ~300 tokens) cut from the tokenizer's own training text."""
    import inspect
    import json

    text = inspect.getsource(json) * 3
    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    lengths = [3, 7, 15, 16, 17, 31, 33, 48, 64, 90, 127, 150, 200, 240, 280, 300][:count]
    rng.shuffle(lengths)
    return [ids[(start := rng.randrange(0, len(ids) - n)) : start + n] for n in lengths]


def test_greedy_equals_transformers_under_preemption_and_chunked_prefill(
    demo_model_dir: Path, hf_model: Any, tokenizer: Any
) -> None:
    prompts = _prompts(tokenizer, 16, seed=1)
    max_tokens = 24
    # 40 blocks of 16 hold 640 tokens; 16 sequences of ~135 tokens on average need ~2,200.
    engine = make_engine(
        demo_model_dir,
        num_kv_blocks=40,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        max_model_len=512,
    )
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_work:
        if pending and step % 3 == 0:  # arrivals spread over time
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens)
            engine.add_request(EngineRequest(f"r{i}", params, prompt_token_ids=prompt))
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
        step += 1

    stats = engine.stats()
    assert stats.preemptions > 0, "the KV pool was meant to be small enough to force preemption"
    assert stats.kv_blocks_used == 0
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(hf_model, prompt, max_tokens), (
            f"prompt {i} ({len(prompt)} tokens)"
        )


def test_shared_prefix_computes_only_the_suffix(
    demo_model_dir: Path, hf_model: Any, tokenizer: Any
) -> None:
    engine = make_engine(demo_model_dir)
    base = _prompts(tokenizer, 16, seed=2)
    prefix = [t for p in base for t in p][:48]  # exactly 3 blocks of 16
    first = prefix + base[0][:5]
    second = prefix + base[1][:11]
    params = SamplingParams(max_tokens=8)

    run_to_completion(engine, [EngineRequest("first", params, prompt_token_ids=first)])
    computed_before = engine.stats().prompt_tokens_computed
    out = run_to_completion(engine, [EngineRequest("second", params, prompt_token_ids=second)])

    assert engine.stats().prompt_tokens_computed - computed_before == len(second) - 48
    final = out["second"][-1]
    assert final.usage is not None and final.usage.cached_tokens == 48
    tokens = [t for o in out["second"] for t in o.token_ids]
    assert tokens == hf_greedy(hf_model, second, 8)


def test_a_prompt_nobody_sent_before_reports_no_cached_tokens_after_a_preemption(
    demo_model_dir: Path,
) -> None:
    """Three tenants' (salts') new prompts on a KV pool too small for all three: the newest is
    preempted mid-prefill and recomputed, partly from its own blocks. Reporting those as
    `cached_tokens` would call a prompt no request ever sent cached, and tell its tenant that
    other tenants' load preempted it."""
    engine = make_engine(
        demo_model_dir, max_model_len=256, num_kv_blocks=20, max_num_batched_tokens=64
    )
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    requests = [
        EngineRequest(
            f"r{i}",
            params,
            prompt_token_ids=[(i * 7 + j) % 4000 + 5 for j in range(150)],
            cache_salt=f"t{i}",
        )
        for i in range(3)
    ]
    out = run_to_completion(engine, requests)
    stats = engine.stats()
    assert stats.preemptions > 0, "the KV pool was meant to force a preemption mid-prefill"
    usage = {r: o[-1].usage for r, o in out.items()}
    assert {r: u.cached_tokens if u else None for r, u in usage.items()} == dict.fromkeys(out, 0)
    assert stats.prefix_cache_hit_tokens == 0


def test_prefix_cache_distinguishes_adapter_identity(demo_model_dir: Path, tokenizer: Any) -> None:
    engine = make_engine(demo_model_dir)
    prompt = _prompts(tokenizer, 16, seed=3)[-1][:40]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    run_to_completion(engine, [EngineRequest("a", params, prompt_token_ids=prompt)])
    hits = engine.stats().prefix_cache_hit_tokens
    matched = engine.block_manager.match_prefix
    from loramux.engine.sequence import Sequence

    assert len(matched(Sequence("x", prompt, params)).block_ids) == 2
    assert (
        matched(Sequence("y", prompt, params, adapter_id="digest-of-some-adapter")).num_tokens == 0
    )
    assert engine.stats().prefix_cache_hit_tokens == hits


def test_stop_strings_are_not_the_engines_business(demo_model_dir: Path, tokenizer: Any) -> None:
    """The engine sees token ids only: a stop string changes nothing there (the gateway matches
    it on the text and aborts the sequence)."""
    engine = make_engine(demo_model_dir)
    prompt = _prompts(tokenizer, 16, seed=4)[5]
    runs = {
        name: EngineRequest(
            name, SamplingParams(max_tokens=40, ignore_eos=True, stop=stop), prompt_token_ids=prompt
        )
        for name, stop in (("free", ()), ("stop", (" ",)))
    }
    outputs = run_to_completion(engine, list(runs.values()))
    tokens = {name: [t for o in outs for t in o.token_ids] for name, outs in outputs.items()}
    assert tokens["free"] == tokens["stop"] and len(tokens["free"]) == 40
