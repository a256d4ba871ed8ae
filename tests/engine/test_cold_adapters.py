"""Cold adapters: a request whose adapter is still being copied into its device slot starts at
once on the host-computed path, with PEFT's output; hundreds of adapters through a small
budget, with aborts and retirements at every stage, leave nothing pinned, held or loading;
prefetch hints are bounded."""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel

from loramux.engine.errors import AdapterUnavailableError
from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.engine.sequence import FinishReason
from loramux.engine.service.wire import error_from, failure
from tests.adapters.peft_adapters import lora_key, save_weights
from tests.engine.adapter_batches import run_tokens
from tests.engine.conftest import make_engine
from tests.engine.test_multi_lora import peft_greedy

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cold_peft(demo_model_dir: Path, demo_adapter_dirs: list[Path]) -> Any:
    """PEFT holding demo adapters 0-4 (all five target sets, ranks 8-64) by folder name."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    first, *rest = demo_adapter_dirs[:5]
    model = PeftModel.from_pretrained(base, first, adapter_name=first.name)
    for folder in rest:
        model.load_adapter(folder, adapter_name=folder.name)
    return model.eval()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(rng.randrange(5, 40))]


def test_a_request_starts_before_its_adapter_is_on_the_device_and_equals_peft(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], cold_peft: Any
) -> None:
    # Four (layer, group) blocks copied per step, shared by the copies in turn: the demo
    # model's 16 blocks per adapter put the five adapters on the device after 4, 8, ... 20
    # steps, so every request starts on the host path and switches to its slot mid-request.
    engine = make_engine(demo_model_dir, max_loras=8, lora_copy_groups_per_step=4)
    folders = demo_adapter_dirs[:5]
    digests = {f.name: engine.register_adapter(f) for f in folders}
    requests = [
        EngineRequest(
            f"{name}-{k}",
            SamplingParams(max_tokens=MAX_TOKENS),
            prompt_token_ids=_prompt(10 * i + k),
            adapter=digests[name],
        )
        for i, name in enumerate(digests)
        for k in range(2)
    ]
    requests.append(
        EngineRequest("base", SamplingParams(max_tokens=MAX_TOKENS), prompt_token_ids=_prompt(99))
    )

    tokens = run_tokens(engine, requests)

    stats = engine.adapter_stats()
    for name, digest in digests.items():
        s = stats[digest]
        assert s.first_token_step is not None and s.device_ready_step is not None, name
        assert s.first_token_step < s.device_ready_step, f"{name} waited for its device copy"
        assert s.host_path_tokens > 0, name
        assert s.device_ready_step - s.first_token_step < MAX_TOKENS, f"{name} never switched"
    for r in requests:
        name = next((n for n, d in digests.items() if d == r.adapter), None)
        expected = peft_greedy(cold_peft, name, r.prompt_token_ids or [], MAX_TOKENS)
        assert tokens[r.request_id] == expected, r.request_id


def _tiny_adapters(template: Path, out: Path, count: int) -> list[Path]:
    """`count` distinct rank-1 q/v adapters for the demo model, written straight to disk with the
    config of `template` (a PEFT-written q/v adapter) and seeded weights."""
    config = json.loads((template / "adapter_config.json").read_text())
    config.update(r=1, lora_alpha=2, use_rslora=False)
    generator = torch.Generator().manual_seed(7)
    folders = []
    for index in range(count):
        folder = out / f"tiny-{index:03d}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        tensors = {}
        for layer in range(4):
            for proj, out_features in (("q", 256), ("v", 64)):
                tensors[lora_key(layer, proj, "A")] = torch.randn(1, 256, generator=generator)
                tensors[lora_key(layer, proj, "B")] = torch.randn(out_features, 1) * 0.01
        save_weights(folder, tensors)
        folders.append(folder)
    return folders


def _drain_loads(engine: LLMEngine) -> None:
    """Step an idle engine until loads and device copies still under way have finished."""
    lora = engine.lora
    assert lora is not None
    deadline = time.monotonic() + 60
    while lora.in_flight_loads() or len(lora.copies):
        assert time.monotonic() < deadline, "loads or copies never finished"
        engine.step()


def test_five_hundred_adapters_through_a_small_budget_leave_nothing_behind(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    q_v = demo_adapter_dirs[3]  # adapters.demo cycles target sets: the fourth is q and v
    targets = json.loads((q_v / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == ["q_proj", "v_proj"]
    folders = _tiny_adapters(q_v, tmp_path, 500)
    engine = make_engine(
        demo_model_dir,
        max_loras=16,
        max_cpu_loras=24,
        max_num_seqs=32,
        lora_load_workers=3,
        lora_copy_groups_per_step=4,
    )
    lora = engine.lora
    assert lora is not None
    digests = [engine.register_adapter(f) for f in folders]
    assert len(set(digests)) == 500
    assert lora.host_tier_size() <= 24

    rng = random.Random(3)
    order = list(range(500))
    rng.shuffle(order)
    pending = [
        EngineRequest(
            f"r{i}", SamplingParams(max_tokens=2), prompt_token_ids=_prompt(i), adapter=digests[i]
        )
        for i in order
    ]
    finished: set[str] = set()
    aborted: set[str] = set()
    loading: list[str] = []
    steps = 0
    while pending or engine.has_work:
        for request_id in loading:  # aborted a step after arriving: while its adapter loads
            if engine.abort(request_id) is not None:
                aborted.add(request_id)
        loading = [r.request_id for r in pending[:16] if int(r.request_id[1:]) % 7 == 0]
        for r in pending[:16]:
            engine.add_request(r)
            if int(r.request_id[1:]) % 11 == 0:  # retired with its request in flight
                engine.retire_adapter(r.adapter or "")
        del pending[:16]
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
            elif int(out.request_id[1:]) % 5 == 0:  # aborted mid-request, maybe mid-copy
                engine.abort(out.request_id)
                aborted.add(out.request_id)
        steps += 1
        assert steps < 5000, "requests starved"
    _drain_loads(engine)

    assert finished | aborted == {f"r{i}" for i in range(500)}
    assert any(int(r[1:]) % 7 == 0 for r in aborted), "no request was aborted while loading"
    assert all(slot.pins == 0 for slot in lora.slots)
    assert lora.in_flight_loads() == 0 and len(lora.copies) == 0
    counts = lora.host_buffers.counts()
    assert counts.in_use == lora.host_tier_size() <= 24, "a host buffer leaked"
    assert counts.in_use + counts.free <= counts.capacity
    assert engine.stats().kv_blocks_used == 0
    assert sum(s.host_path_tokens for s in engine.adapter_stats().values()) > 0


def test_prefetch_hints_are_bounded_and_ignore_unknown_and_retired_adapters(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    engine = make_engine(demo_model_dir, max_loras=1, max_cpu_loras=1, lora_load_workers=1)
    lora = engine.lora
    assert lora is not None
    digests = [engine.register_adapter(f) for f in demo_adapter_dirs[:12]]
    engine.retire_adapter(digests[0])
    for digest in ("f" * 64, "", digests[0], *digests[1:]):
        engine.prefetch_adapter(digest)
        assert lora.in_flight_loads() <= lora.max_hinted_loads == 2
    _drain_loads(engine)
    stats = engine.adapter_stats()
    assert stats[digests[0]].hinted_loads == 0, "a retired adapter was loaded by a hint"
    assert 1 <= sum(s.hinted_loads for s in stats.values()) <= 11
    assert lora.host_buffers.counts().in_use == lora.host_tier_size() == 1


@pytest.mark.parametrize("change", ["deleted", "changed"])
def test_a_request_whose_adapter_can_no_longer_be_read_fails_and_the_engine_idles(
    demo_model_dir: Path,
    demo_adapter_dirs: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    change: str,
) -> None:
    """Bug: a registered adapter that had left the host tier and whose folder was then deleted
    (the gateway deletes a deleted adapter's files) or changed on disk failed to load, and the
    failure was dropped: its request waited forever while every step started another load (the
    step loop busy-spun). Now the load is tried once, the request fails with an error naming
    its adapter, the engine idles, and a later request, once the folder is back, loads it again."""
    folder = tmp_path / "adapter"
    shutil.copytree(demo_adapter_dirs[0], folder)
    engine = make_engine(demo_model_dir, max_loras=1, max_cpu_loras=1)
    lora = engine.lora
    assert lora is not None
    digest = engine.register_adapter(folder)
    engine.register_adapter(demo_adapter_dirs[1])  # takes the host tier's only place
    assert digest not in lora.resident()
    shutil.rmtree(folder)
    if change == "changed":
        shutil.copytree(demo_adapter_dirs[2], folder)
    params = SamplingParams(max_tokens=3, n=2)

    def run(request_id: str) -> list[RequestOutput]:
        engine.add_request(
            EngineRequest(request_id, params, prompt_token_ids=[1, 2, 3], adapter=digest)
        )
        outputs: list[RequestOutput] = []
        deadline = time.monotonic() + 30
        while engine.has_work:
            assert time.monotonic() < deadline, "the request never ended"
            outputs += engine.step()
        return outputs

    with caplog.at_level(logging.ERROR):
        failed = run("r")
    assert sum("could not be reloaded" in r.getMessage() for r in caplog.records) == 1
    # The request fails as a whole: its last output says why, its other choice ends with it.
    assert [(o.finish_reason, o.is_last) for o in failed] == [(FinishReason.ERROR, True)]
    assert not engine.outputs.open_choices("r")
    assert failed[-1].error is not None and "adapter" in failed[-1].error
    # Its stream raises it as the adapter's failure, also across the engine channel.
    assert failed[-1].error_type is AdapterUnavailableError
    crossed = error_from(failure("r", False, failed[-1].error_type(failed[-1].error)))
    assert isinstance(crossed, AdapterUnavailableError)
    assert engine.stats().kv_blocks_used == 0 and lora.in_flight_loads() == 0

    shutil.rmtree(folder, ignore_errors=True)  # the adapter's files are back
    shutil.copytree(demo_adapter_dirs[0], folder)
    served = run("again")
    assert {(o.index, o.finish_reason) for o in served if o.finish_reason} == {
        (0, FinishReason.LENGTH),
        (1, FinishReason.LENGTH),
    }
    assert digest in lora.resident()
