"""One request's fault fails that request alone: the rest of its batch is served as if it had
not been there, and the engine keeps serving every later request."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loramux.adapters.errors import NonFiniteWeights
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.errors import RequestFailedError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from tests.adapters.peft_adapters import edit_weights
from tests.engine.conftest import make_engine, run_to_completion

MAX_TOKENS = 10


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _healthy(tag: str, good: str) -> list[EngineRequest]:
    """Base and adapter requests, greedy and seeded; prompt lengths 20 to 29 tokens, so they
    decode in one length bucket and their last blocks are partly empty."""
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        EngineRequest(f"{tag}-base", greedy, prompt_token_ids=list(range(300, 320))),
        EngineRequest(f"{tag}-good", greedy, prompt_token_ids=list(range(400, 426)), adapter=good),
        EngineRequest(f"{tag}-seeded", sampled, prompt_token_ids=list(range(500, 529))),
    ]


def _by_role(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid.split("-", 1)[1]: _tokens(outs) for rid, outs in outputs.items()}


def test_non_finite_logits_fail_only_their_request_in_a_mixed_batch(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], overflowing_adapter: Path
) -> None:
    engine: LLMEngine = make_engine(demo_model_dir, max_loras=4, num_kv_blocks=64)
    good = engine.register_adapter(demo_adapter_dirs[0])
    bad = engine.register_adapter(overflowing_adapter)
    alone = _by_role(run_to_completion(engine, _healthy("alone", good)))

    poisoned = [
        EngineRequest(
            f"bad-{i}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=list(range(600 + 50 * i, 640 + 50 * i)),
            adapter=bad,
        )
        for i in range(2)
    ]
    mixed = run_to_completion(engine, [poisoned[0], *_healthy("mixed", good), poisoned[1]])
    assert engine.stats().steps > 0
    for r in poisoned:
        (final,) = mixed.pop(r.request_id)
        assert final.finish_reason is FinishReason.ERROR
        assert final.error is not None and "not finite" in final.error
        assert final.token_ids == [] and final.usage is not None
    assert _by_role(mixed) == alone

    # Blocks the failed requests wrote are reused now; nothing of theirs leaks into others.
    assert _by_role(run_to_completion(engine, _healthy("after", good))) == alone
    assert engine.stats().kv_blocks_used == 0
    assert engine.lora is not None and all(slot.pins == 0 for slot in engine.lora.slots)


async def test_a_failed_request_raises_on_its_own_stream_and_others_finish(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], overflowing_adapter: Path
) -> None:
    engine = AsyncEngine(make_engine(demo_model_dir, max_loras=4, num_kv_blocks=64))
    engine.start()
    try:
        good = await engine.register_adapter(demo_adapter_dirs[0])
        bad = await engine.register_adapter(overflowing_adapter)

        async def collect(request: EngineRequest) -> list[int] | Exception:
            try:
                return _tokens([out async for out in engine.generate(request)])
            except RequestFailedError as exc:
                return exc

        healthy = _healthy("first", good)
        poisoned = EngineRequest(
            "bad", SamplingParams(max_tokens=MAX_TOKENS), prompt="def f(x):", adapter=bad
        )
        *results, failed = await asyncio.gather(*map(collect, healthy), collect(poisoned))
        assert isinstance(failed, RequestFailedError) and "not finite" in str(failed)
        assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in results)
        assert engine.running
        again = await asyncio.gather(*map(collect, _healthy("again", good)))
        assert again == results
    finally:
        engine.shutdown()


class DeviceWithLittleMemory(TorchDispatchMode):
    """A fake device at the edge of what runs here: it runs out of memory (raising the error
    a GPU raises) when a step embeds more than `max_tokens` tokens, and computes otherwise."""

    def __init__(self, max_tokens: int):
        super().__init__()
        self.max_tokens = max_tokens

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.embedding.default and args[1].numel() > self.max_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory (a fake device's)")
        return func(*args, **(kwargs or {}))


def test_a_step_the_device_cannot_compute_fails_only_the_requests_in_it(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    engine = make_engine(demo_model_dir, max_num_seqs=2, max_num_batched_tokens=512)
    adapter = engine.register_adapter(demo_adapter_dirs[1])
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    def request(request_id: str, prompt: list[int]) -> EngineRequest:
        on_adapter = request_id.endswith("huge")
        return EngineRequest(
            request_id, params, prompt_token_ids=prompt, adapter=adapter if on_adapter else None
        )

    short, waiting = list(range(700, 712)), list(range(900, 914))
    huge = [800 + i % 50 for i in range(300)]
    expected = _by_role(run_to_completion(engine, [request("alone-short", short)]))

    outputs: list[RequestOutput] = []
    with DeviceWithLittleMemory(max_tokens=256):
        engine.add_request(request("in-short", short))
        outputs += engine.step()  # its prefill: 12 tokens fit
        engine.add_request(request("in-huge", huge))
        engine.add_request(request("later-short", waiting))  # max_num_seqs=2: it waits
        failed = engine.step()  # a decode and a 300-token prefill: too much for the device
        assert {o.request_id: o.finish_reason for o in failed} == {
            "in-short": FinishReason.ERROR,
            "in-huge": FinishReason.ERROR,
        }
        assert all(o.error and "failed while computing" in o.error for o in failed)
        while engine.has_work:
            outputs += engine.step()
        served = run_to_completion(engine, [request("again-short", short)])
    later = [o for o in outputs if o.request_id == "later-short"]
    assert later[-1].finish_reason == "length" and len(_tokens(later)) == MAX_TOKENS
    assert _by_role(served) == expected
    assert engine.stats().kv_blocks_used == 0
    assert engine.lora is not None and all(slot.pins == 0 for slot in engine.lora.slots)


def test_an_adapter_beyond_what_the_engines_dtype_holds_is_refused_when_registered(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    """Finite in float32, its lora_B would be infinite in a float16 engine's adapter memory,
    where a decode step's per-token kernels multiply it with a block of tokens whose rows of
    other adapters are zeroed: 0 x inf = NaN would reach other tenants' requests. A float16
    engine refuses it; a float32 one, which holds it, serves it."""
    folder = tmp_path / "beyond-float16"
    shutil.copytree(demo_adapter_dirs[0], folder)
    edit_weights(folder, lambda ws: {n: w * 1e5 if "lora_B" in n else w for n, w in ws.items()})
    half = make_engine(demo_model_dir, dtype="float16")
    with pytest.raises(NonFiniteWeights, match="65504") as refused:
        half.register_adapter(folder)
    assert refused.value.code == "non_finite_weights"
    assert half.adapter_stats() == {}
    assert half.register_adapter(demo_adapter_dirs[0])  # a float16-sized adapter still registers
    full = make_engine(demo_model_dir)
    digest = full.register_adapter(folder)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    request = EngineRequest("big", params, prompt_token_ids=list(range(40, 60)), adapter=digest)
    outputs = run_to_completion(full, [request])["big"]
    assert outputs[-1].finished and outputs[-1].error is None
