"""The engine's Prometheus metrics: request phases observed once per request, cumulative values
as `_total` counters, and per-adapter series only while the adapter is resident."""

from __future__ import annotations

import threading
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(text: str, name: str, **labels: str) -> float:
    return _samples(text)[(name, tuple(sorted(labels.items())))]


def test_each_finished_request_is_one_observation_of_every_phase(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", params, prompt_token_ids=[5, 6, 7, 8 + i]) for i in range(3)]
    outputs = run_to_completion(engine, requests)
    text = engine.metrics.render()
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time", "time_to_first_token"):  # fmt: skip
        assert _value(text, f"loramux_{phase}_seconds_count") == 3, phase
    # 5 tokens per request: 4 intervals each.
    assert _value(text, "loramux_inter_token_latency_seconds_count") == 12
    assert _value(text, "loramux_generation_tokens_total") == 15
    assert _value(text, "loramux_prefix_cache_queries_total") == 12
    for outs in outputs.values():
        timings = outs[-1].timings
        assert timings is not None and timings.scheduled is not None
        assert timings.first_token is not None
        assert timings.arrived <= timings.scheduled <= timings.first_token <= timings.finished


def test_an_aborted_waiting_request_counts_its_latency_but_no_phase(demo_model_dir: Path) -> None:
    engine = make_engine(demo_model_dir)
    engine.add_request(EngineRequest("gone", SamplingParams(max_tokens=4), prompt_token_ids=[9]))
    final = engine.abort("gone")
    assert final is not None and final.timings is not None and final.timings.scheduled is None
    text = engine.metrics.render()
    assert _value(text, "loramux_e2e_request_latency_seconds_count") == 1
    assert _value(text, "loramux_request_queue_time_seconds_count") == 0
    assert _value(text, "loramux_engine_aborted_requests_total") == 1


def test_adapter_series_exist_while_it_is_resident(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    engine = make_engine(demo_model_dir, enable_lora=True, max_loras=1, max_cpu_loras=1)
    digest = engine.register_adapter(demo_adapter_dirs[0])
    params = SamplingParams(max_tokens=2)
    run_to_completion(engine, [EngineRequest("a", params, prompt_token_ids=[5], adapter=digest)])
    text = engine.metrics.render()
    assert _value(text, "loramux_lora_adapter_loaded", adapter=digest, tier="device") == 1
    assert _value(text, "loramux_lora_adapter_running_requests", adapter=digest) == 0
    assert _value(text, "loramux_lora_adapter_loads_total", adapter=digest) >= 1
    assert engine.lora is not None
    held = _value(text, "loramux_lora_adapter_device_bytes", adapter=digest)
    used, total = engine.lora.memory()
    assert 0 < held == used == _value(text, "loramux_lora_memory_used_bytes")
    assert _value(text, "loramux_lora_memory_free_bytes") == total - used

    engine.retire_adapter(digest)
    run_to_completion(engine, [EngineRequest("b", params, prompt_token_ids=[5])])  # a sweep
    assert digest not in engine.metrics.render()


def test_cold_path_series_count_loads_host_path_tokens_and_buffers(
    demo_model_dir: Path, demo_adapter_dirs: list[Path]
) -> None:
    # Two (layer, group) blocks copied per step: the demo model's 16 take 8 steps, during which
    # the request runs on the host path.
    engine = make_engine(demo_model_dir, max_loras=1, lora_copy_groups_per_step=2)
    digest = engine.register_adapter(demo_adapter_dirs[0])
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    run_to_completion(engine, [EngineRequest("a", params, prompt_token_ids=[5], adapter=digest)])
    text = engine.metrics.render()
    assert _value(text, "loramux_lora_load_seconds_count") == 1  # the registration's read
    assert _value(text, "loramux_lora_host_path_tokens_total") == 4  # the prompt and 3 decodes
    assert _value(text, "loramux_lora_hinted_loads_total") == 0
    assert _value(text, "loramux_lora_loads_in_flight") == 0
    assert _value(text, "loramux_lora_copies_in_flight") == 1  # idle: the copy waits for a step
    assert _value(text, "loramux_lora_host_buffers", state="in_use") == 1


def test_stats_and_metrics_read_off_the_step_thread_never_fail(demo_model_dir: Path) -> None:
    """The engine service's `stats` call (gateways' /ready and routing) and /metrics read the
    engine's state from another thread while the step thread changes it. Counting the cached
    free blocks by a pass over the free list raised `OrderedDict mutated during iteration` a
    few times a run here (a 50,000-block pool, as on a GPU, and 40 requests)."""
    engine = make_engine(demo_model_dir, max_model_len=128, num_kv_blocks=50_000, enable_lora=False)
    errors: list[Exception] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                engine.stats()
                engine.metrics.render()
            except Exception as exc:
                errors.append(exc)

    reader = threading.Thread(target=scrape)
    reader.start()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(40):
        engine.add_request(EngineRequest(f"r{i}", params, prompt_token_ids=list(range(3, 103))))
    try:
        while engine.has_work:
            engine.step()
    finally:
        stop.set()
        reader.join()
    assert not errors, errors[:3]
