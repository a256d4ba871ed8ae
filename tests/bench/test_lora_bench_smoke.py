"""The multi-LoRA benchmarks' smallest paths run end to end and write complete result files.

Speed is never checked against a goal here; correctness figures are (the engine equals PEFT,
the kernels equal a torch loop), and so are facts that do not depend on timing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import lora_batching, lora_kernels

RESULT_FIELDS = {"benchmark", "mode", "command", "created", "machine", "model", "workload"}
RESULT_FIELDS |= {"settings", "figures", "details"}
FIGURE_FIELDS = {"name", "value", "unit", "goal", "met"}


@pytest.fixture(scope="module")
def restore_threads() -> Iterator[None]:
    """The benchmarks pin torch's threads; give the rest of the session its own count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def smoke_args(model_dir: Path, out: Path) -> list[str]:
    """One thread: on a busy two-core machine, two threads mostly wait for each other."""
    return ["--threads", "1", "--model-dir", str(model_dir), "--results-dir", str(out)]


@pytest.fixture(scope="module")
def batching(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, restore_threads: None
) -> Any:
    out = tmp_path_factory.mktemp("results")
    path = lora_batching.main(["--smoke", *smoke_args(demo_model_dir, out)])
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def kernels(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, restore_threads: None
) -> Any:
    out = tmp_path_factory.mktemp("results")
    path = lora_kernels.main(["--interpret-smoke", *smoke_args(demo_model_dir, out)])
    assert path is not None
    return path, json.loads(path.read_text())


def assert_complete(result: dict[str, Any], name: str, goals: int) -> None:
    assert result.keys() >= RESULT_FIELDS
    assert (result["benchmark"], result["mode"]) == (name, "smoke")
    figures = result["figures"]
    assert figures and all(f.keys() >= FIGURE_FIELDS for f in figures)
    assert all(isinstance(f["value"], int | float) for f in figures)
    with_goal = [f for f in figures if f["goal"] is not None]
    assert len(with_goal) == goals
    assert all(isinstance(f["met"], bool) for f in with_goal)


def figure(result: dict[str, Any], prefix: str) -> dict[str, Any]:
    return next(f for f in result["figures"] if f["name"].startswith(prefix))


def test_lora_batching_writes_a_complete_result(batching: Any) -> None:
    path, result = batching
    assert path.name == "lora_batching-smoke.json"
    assert_complete(result, "lora_batching", goals=5)
    assert figure(result, "(a) engine / best PEFT")["goal"] == ">= 5"
    assert figure(result, "(d) tokens/s DoRA / plain LoRA")["goal"] == ">= 0.9"
    assert set(result["details"]["dora"]) == {"plain", "dora"}
    engine_cases = [c for c in result["details"]["cases"].values() if "slot_loads" in c]
    timed_loads = [c["slot_loads"] for c in engine_cases]
    timed_loads += [c["slot_loads"] for c in result["details"]["dora"].values()]
    assert timed_loads and all(loads == [0] for loads in timed_loads), "adapters were swapped"


def test_lora_batching_engine_equals_peft_for_every_adapter(batching: Any) -> None:
    _, result = batching
    assert figure(result, "(a) greedy outputs equal to PEFT")["value"] == 1.0


def test_lora_batching_stream_times_every_request(batching: Any) -> None:
    _, result = batching
    workload, streams = result["workload"], result["details"]["streams"]
    for case in ("few", "resident"):
        assert len(streams[case]["ttft"]) == workload["stream"]
        assert all(t > 0 for t in streams[case]["ttft"])
    assert streams["resident"]["slot_loads"] == streams["resident"]["host_loads"] == 0


def test_lora_kernels_without_cuda_says_so_and_writes_nothing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full benchmark would run")
    assert lora_kernels.main(["--results-dir", str(tmp_path)]) is None
    assert not any(tmp_path.iterdir())


def test_lora_kernels_smoke_writes_a_complete_result(kernels: Any) -> None:
    path, result = kernels
    assert path.name.startswith("lora_kernels") and path.name.endswith("-smoke.json")
    assert_complete(result, "lora_kernels", goals=len(result["workload"]["batch_sizes"]))


def test_lora_kernels_equal_the_torch_loop(kernels: Any) -> None:
    _, result = kernels
    cases = result["details"]["kernels"]
    assert {c["kind"] for c in cases} == {"decode", "prefill"}
    for c in cases:  # bf16 outputs: a few units in the last place of the largest value
        assert c["max_abs_diff_vs_loop"] <= 0.02 * c["max_abs_output"], c["name"]
