"""Decode steps as CUDA graphs: a ladder of batch sizes, padding rows that change nothing for
the real ones, and on a GPU the same tokens as eager decoding, adapters included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.engine.cuda_graphs import graph_batches
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion


def test_the_ladder_covers_every_batch_up_to_the_largest_with_little_padding() -> None:
    ladder = graph_batches(256)
    assert ladder[:5] == (1, 2, 4, 8, 12) and ladder[-1] == 256 and len(ladder) == 22
    assert graph_batches(3) == (1, 2, 3) and graph_batches(100)[-1] == 100
    for batch in range(9, 257):
        padded = next(b for b in ladder if b >= batch)
        assert padded - batch <= padded / 4


def _requests(adapters: list[str]) -> list[EngineRequest]:
    """Eleven requests on three adapters and the base model (all on the base model without
    adapters), greedy and seeded, ending at
    different steps so the decode batch shrinks through many graph sizes."""
    out = []
    for i in range(11):
        params = SamplingParams(
            max_tokens=4 + 3 * i,
            temperature=0.8 if i % 3 == 0 else 0.0,
            seed=i,
            ignore_eos=True,
        )
        adapter = adapters[i % len(adapters)] if i % 4 and adapters else None
        prompt = [(31 * i + 7 * k) % 3000 + 5 for k in range(6 + i)]
        out.append(EngineRequest(f"r{i}", params, prompt_token_ids=prompt, adapter=adapter))
    return out


def test_padding_rows_change_nothing_for_the_real_rows(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    # Copies of 48 (layer, group) blocks per step: the three adapters' device copies complete
    # at the next step, so the decodes below read slots (a graph cannot run the host path).
    engine = make_engine(
        demo_model_dir, max_loras=4, async_scheduling=False, lora_copy_groups_per_step=48
    )
    adapters = [engine.register_adapter(d) for d in demo_adapter_dirs[:3]]
    for request in _requests(adapters)[:5]:
        engine.add_request(request)
    engine.step()  # prefills: every request is decoding from now on
    assert engine.lora is not None
    engine.lora.advance()
    assert len(engine.lora.copies) == 0
    batch = engine.scheduler.schedule()
    assert len(batch.chunks) == 5 and all(c.num_tokens == 1 for c in batch.chunks)
    eager = engine.runner.run(engine.runner.prepare(batch.chunks))
    padded_inputs = engine.runner.prepare(batch.chunks, pad_to=8)
    assert padded_inputs.graph_batch == 8 and padded_inputs.input_ids.shape == (8,)
    padded = engine.runner.run(padded_inputs)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(dim=-1), eager.argmax(dim=-1))


def test_a_padded_step_without_adapters_runs_no_lora_kernels(demo_model_dir: Path) -> None:
    """Base-model decodes padded for a graph carry no LoRA batch: the graph without the LoRA
    kernels replays them, and they compute what the eager step does."""
    engine = make_engine(demo_model_dir, max_loras=4, async_scheduling=False)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(3):
        prompt = [(11 * i + 5 * k) % 3000 + 5 for k in range(7 + i)]
        engine.add_request(EngineRequest(f"b{i}", params, prompt_token_ids=prompt))
    engine.step()
    batch = engine.scheduler.schedule()
    assert len(batch.chunks) == 3 and all(c.num_tokens == 1 for c in batch.chunks)
    eager_inputs = engine.runner.prepare(batch.chunks)
    assert eager_inputs.context.lora is None
    eager = engine.runner.run(eager_inputs)
    padded_inputs = engine.runner.prepare(batch.chunks, pad_to=4)
    assert padded_inputs.graph_batch == 4 and padded_inputs.context.lora is None
    padded = engine.runner.run(padded_inputs)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_graph_decoding_equals_eager_decoding_with_mixed_adapters(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    results = []
    for graphs in (True, False):
        engine = make_engine(demo_model_dir, device="cuda", max_loras=4, cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        adapters = [engine.register_adapter(d) for d in demo_adapter_dirs[:3]]
        outputs = run_to_completion(engine, _requests(adapters))
        results.append(
            {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
        )
        assert engine.stats().kv_blocks_used == 0
        if engine.runner.graphs is not None:
            assert engine.runner.graphs.replays[True] > 0
    assert results[0] == results[1]


@pytest.mark.gpu
def test_base_model_decodes_replay_the_graphs_without_lora_kernels(demo_model_dir: Path) -> None:
    results = []
    for graphs in (True, False):
        engine = make_engine(demo_model_dir, device="cuda", max_loras=4, cuda_graphs=graphs)
        outputs = run_to_completion(engine, _requests([]))
        results.append(
            {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
        )
        if engine.runner.graphs is not None:
            replays = engine.runner.graphs.replays
            assert replays[False] > 0 and replays[True] == 0
    assert results[0] == results[1]


@pytest.mark.gpu
def test_graph_memory_is_counted_in_the_kv_budget(demo_model_dir: Path) -> None:
    budget = {"num_kv_blocks": None, "kv_cache_bytes": 64 << 20, "device": "cuda"}
    with_graphs = make_engine(demo_model_dir, **budget)
    without = make_engine(demo_model_dir, cuda_graphs=False, **budget)
    assert with_graphs.runner.graph_memory() > 0
    assert with_graphs.stats().kv_blocks_total < without.stats().kv_blocks_total
