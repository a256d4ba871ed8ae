"""Multi-LoRA serving: mixed batches equal PEFT per adapter; many adapters through few slots;
hot swap; the prefix cache never mixes adapters."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loramux.engine.errors import InvalidRequestError, UnknownAdapterError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.lora.stats import Readiness
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import Sequence
from tests.engine.conftest import hf_greedy, make_engine, run_to_completion

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def peft_model(demo_model_dir: Path, demo_adapter_dirs: list[Path]) -> Any:
    """One PeftModel holding every demo adapter under the name of its folder."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(
        base, demo_adapter_dirs[0], adapter_name=demo_adapter_dirs[0].name
    )
    for folder in demo_adapter_dirs[1:]:
        model.load_adapter(folder, adapter_name=folder.name)
    return model.eval()


def peft_greedy(
    model: Any, adapter: str | None, prompt: list[int], max_new_tokens: int
) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            adapter_names=[adapter or "__base__"],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 4096) for _ in range(rng.randrange(4, 60))]


def _tokens(outputs: list[Any]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_mixed_batch_equals_peft_for_every_adapter(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], peft_model: Any
) -> None:
    engine = make_engine(demo_model_dir, max_loras=12)
    chosen = demo_adapter_dirs[:10]  # ranks 8-64 and all five target sets
    digests = {f.name: engine.register_adapter(f) for f in chosen}
    requests = [
        EngineRequest(
            f"{name}-{k}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=_prompt(i * 3 + k),
            adapter=digests[name],
        )
        for i, name in enumerate(digests)
        for k in range(2)
    ]
    requests += [
        EngineRequest(
            f"base-{k}", SamplingParams(max_tokens=MAX_TOKENS), prompt_token_ids=_prompt(100 + k)
        )
        for k in range(3)
    ]
    out = run_to_completion(engine, requests)
    assert engine.stats().steps <= MAX_TOKENS + 2, "all requests were meant to share each step"
    for r in requests:
        name = next((n for n, d in digests.items() if d == r.adapter), None)
        expected = peft_greedy(peft_model, name, r.prompt_token_ids or [], MAX_TOKENS)
        assert _tokens(out[r.request_id]) == expected, r.request_id


def test_forty_adapters_through_eight_slots(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], peft_model: Any
) -> None:
    engine = make_engine(
        demo_model_dir, max_loras=8, max_cpu_loras=12, max_num_seqs=16, num_kv_blocks=128
    )
    digests = [engine.register_adapter(f) for f in demo_adapter_dirs]
    rng = random.Random(5)
    arrivals = [(rng.randrange(0, 40), i) for i in range(60)]  # (step it arrives at, request)
    pending = sorted(arrivals)
    chosen = {i: rng.randrange(40) for i in range(60)}
    outputs: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            params = SamplingParams(max_tokens=6)
            engine.add_request(
                EngineRequest(
                    f"r{i}", params, prompt_token_ids=_prompt(i), adapter=digests[chosen[i]]
                )
            )
            outputs[f"r{i}"] = []
        for o in engine.step():
            outputs[o.request_id].extend(o.token_ids)
            if o.finished:
                finished_at[o.request_id] = step
        step += 1
        assert step < 2000, "requests starved"

    assert len(finished_at) == 60
    stats = engine.adapter_stats()
    assert sum(s.evictions for s in stats.values()) > 0, "40 adapters through 8 slots must evict"
    assert all(slot.pins == 0 for slot in engine.lora.slots) if engine.lora else False
    assert engine.stats().kv_blocks_used == 0
    for i in range(60):
        adapter = demo_adapter_dirs[chosen[i]].name
        assert outputs[f"r{i}"] == peft_greedy(peft_model, adapter, _prompt(i), 6), (
            f"r{i} ({adapter})"
        )


def test_hot_swap_keeps_old_requests_on_old_weights(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], peft_model: Any, tmp_path: Path
) -> None:
    """Version 1 and version 2 of one adapter name; in-flight requests finish on v1."""
    engine = make_engine(demo_model_dir)
    v1, v2 = demo_adapter_dirs[3], demo_adapter_dirs[13]  # same rank and targets, other weights
    d1 = engine.register_adapter(v1)
    prompt = _prompt(7)[:3] + list(range(100, 140))  # 43 tokens: 2 full blocks to cache
    params = SamplingParams(max_tokens=16)
    engine.add_request(EngineRequest("old", params, prompt_token_ids=prompt, adapter=d1))
    first = engine.step()  # "old" is in flight
    assert first and first[0].request_id == "old"
    d2 = engine.register_adapter(v2)  # the re-upload: new digest
    engine.retire_adapter(d1)
    with pytest.raises(UnknownAdapterError):
        engine.validate(EngineRequest("late", params, prompt_token_ids=prompt, adapter=d1))
    engine.add_request(EngineRequest("new", params, prompt_token_ids=prompt, adapter=d2))
    outputs = {"old": list(first[0].token_ids), "new": []}
    while engine.has_work:
        for o in engine.step():
            outputs[o.request_id].extend(o.token_ids)
    assert outputs["old"] == peft_greedy(peft_model, v1.name, prompt, 16)
    assert outputs["new"] == peft_greedy(peft_model, v2.name, prompt, 16)
    assert engine.stats().prefix_cache_hit_tokens == 0, "v2 must not reuse v1's KV blocks"
    engine.step()  # the sweep after the last v1 request ended
    assert engine.lora is not None and not engine.lora.is_servable(d1)
    assert d1 not in {s.digest for s in engine.lora.slots}


def test_prefix_cache_is_reused_within_one_adapter_only(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    engine: LLMEngine = make_engine(demo_model_dir)
    a, b = (engine.register_adapter(f) for f in demo_adapter_dirs[:2])
    prompt = list(range(200, 250))
    params = SamplingParams(max_tokens=2)
    run_to_completion(engine, [EngineRequest("a1", params, prompt_token_ids=prompt, adapter=a)])
    out = run_to_completion(
        engine, [EngineRequest("b1", params, prompt_token_ids=prompt, adapter=b)]
    )
    assert out["b1"][-1].usage is not None and out["b1"][-1].usage.cached_tokens == 0
    out = run_to_completion(engine, [EngineRequest("base", params, prompt_token_ids=prompt)])
    assert out["base"][-1].usage is not None and out["base"][-1].usage.cached_tokens == 0
    out = run_to_completion(
        engine, [EngineRequest("a2", params, prompt_token_ids=prompt, adapter=a)]
    )
    assert out["a2"][-1].usage is not None and out["a2"][-1].usage.cached_tokens == 48


def test_prefix_cache_is_reused_within_one_cache_salt_only(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    engine: LLMEngine = make_engine(demo_model_dir)
    adapter = engine.register_adapter(demo_adapter_dirs[0])
    prompt = list(range(260, 310))  # 3 full blocks of 16 are reusable
    params = SamplingParams(max_tokens=4)

    def run(request_id: str, salt: str | None, on: str | None) -> tuple[int, list[int]]:
        request = EngineRequest(
            request_id, params, prompt_token_ids=prompt, adapter=on, cache_salt=salt
        )
        outputs = run_to_completion(engine, [request])[request_id]
        usage = outputs[-1].usage
        assert usage is not None
        return usage.cached_tokens, _tokens(outputs)

    for on in (None, adapter):
        cached, first = run(f"a1-{on}", "tenant-a", on)
        assert cached == 0
        assert run(f"b1-{on}", "tenant-b", on) == (0, first)
        assert run(f"none1-{on}", None, on) == (0, first)
        assert run(f"a2-{on}", "tenant-a", on) == (48, first)
        assert run(f"b2-{on}", "tenant-b", on) == (48, first)
        assert run(f"none2-{on}", None, on) == (48, first)


def test_an_oversized_or_mistyped_cache_salt_is_refused(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    for salt in ("s" * 1025, 42):
        request = EngineRequest("x", prompt="hi", cache_salt=salt)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            engine.add_request(request)
    assert not engine.has_work


def test_unknown_adapter_is_refused(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    with pytest.raises(UnknownAdapterError):
        engine.add_request(EngineRequest("x", SamplingParams(), prompt="hi", adapter="0" * 64))
    assert not engine.has_work


def test_a_request_checked_before_its_adapter_was_retired_is_refused_when_queued(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    """The async facade checks a request (compiling its schema off the step thread, for up to
    seconds) before it queues it. A retire meanwhile refuses it when it is queued: whether the
    adapter was already dropped (no request used it: the request would wait for it forever)
    or another request still uses it. And a sequence naming a dropped adapter is never left
    waiting for it to load."""
    engine = make_engine(demo_model_dir)
    assert engine.lora is not None
    used, unused = (engine.register_adapter(f) for f in demo_adapter_dirs[:2])
    params = SamplingParams(max_tokens=4)
    running = EngineRequest("running", params, prompt_token_ids=_prompt(1), adapter=used)
    engine.add_request(running)
    late = [
        EngineRequest(f"late-{i}", params, prompt_token_ids=_prompt(2), adapter=digest)
        for i, digest in enumerate((used, unused))
    ]
    checked = [engine.checked(request) for request in late]
    for digest in (used, unused):
        engine.retire_adapter(digest)
    engine.sweep_adapters()
    assert engine.lora.holds(used) and not engine.lora.holds(unused), "unused: dropped"
    for request, check in zip(late, checked, strict=True):
        with pytest.raises(UnknownAdapterError):
            engine.add_request(request, checked=check)
    assert engine.stats().waiting == 1, "the running request alone"
    while engine.has_work:
        engine.step()
    engine.sweep_adapters()
    assert not engine.lora.holds(used), "dropped after its last request"
    dropped = Sequence("orphan", [1, 2, 3], params, adapter_id=unused)
    assert engine.lora.readiness(dropped) is Readiness.FAILED


def test_base_output_unchanged_with_lora_enabled(
    demo_model_dir: Path, hf_model: Any, demo_adapter_dirs: list[Path]
) -> None:
    engine = make_engine(demo_model_dir)
    engine.register_adapter(demo_adapter_dirs[0])
    prompt = _prompt(42)
    out = run_to_completion(
        engine, [EngineRequest("b", SamplingParams(max_tokens=8), prompt_token_ids=prompt)]
    )
    assert _tokens(out["b"]) == hf_greedy(hf_model, prompt, 8)


def test_a_request_waiting_for_a_slot_is_overtaken_only_for_a_bounded_time(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    """One slot, held by adapter A. B waits for it; newer A requests (no new slot needed) may go
    first for `max_slot_wait_steps` steps, then admission stops until the slot frees for B."""
    engine = make_engine(demo_model_dir, max_loras=1, max_num_seqs=64)
    engine.scheduler.max_slot_wait_steps = 3
    a, b = (engine.register_adapter(f) for f in demo_adapter_dirs[:2])
    long = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("a0", long, prompt_token_ids=_prompt(0), adapter=a))
    engine.step()
    engine.add_request(EngineRequest("b", long, prompt_token_ids=_prompt(1), adapter=b))
    started: dict[str, int] = {}
    finished: dict[str, int] = {}
    step = 1
    while engine.has_work:
        if step <= 12:  # a stream of newer A requests
            engine.add_request(
                EngineRequest(f"a{step}", long, prompt_token_ids=_prompt(step + 10), adapter=a)
            )
        for out in engine.step():
            started.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
        step += 1
        assert step < 500
    overtakers = [
        r for r in started if r.startswith("a") and r != "a0" and started[r] < started["b"]
    ]
    assert 1 <= len(overtakers) <= 4, (
        "newer requests overtook B, but only while B's wait budget lasted"
    )
    assert all(started[f"a{i}"] > started["b"] for i in range(5, 13)), (
        "after the budget, B went first"
    )
    assert set(finished) == {"a0", "b", *(f"a{i}" for i in range(1, 13))}
