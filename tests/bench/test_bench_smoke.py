"""The benchmarks' smoke paths run end to end and write result files with every documented field.

No figure is checked against its goal: speed is for the benchmarks to report, not for tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench import engine_throughput, n_choices, prefix_cache

RESULT_FIELDS = {"benchmark", "mode", "command", "created", "machine", "model", "workload"}
RESULT_FIELDS |= {"settings", "figures", "details"}
MACHINE_FIELDS = {"cpu", "cores", "torch_threads", "load_average", "torch", "transformers"}
FIGURE_FIELDS = {"name", "value", "unit", "goal", "met"}


def run_smoke(
    main: Callable[[Sequence[str]], Path], model_dir: Path, out: Path
) -> tuple[Path, dict[str, Any]]:
    path = main(["--smoke", "--model-dir", str(model_dir), "--results-dir", str(out)])
    return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def throughput(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_smoke(engine_throughput.main, demo_model_dir, tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def prefix(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return run_smoke(prefix_cache.main, demo_model_dir, tmp_path_factory.mktemp("results"))


def assert_complete(
    path: Path, result: dict[str, Any], name: str, goals: int, mode: str = "smoke"
) -> None:
    assert path.name == f"{name}-{mode}.json"
    assert result.keys() >= RESULT_FIELDS
    assert (result["benchmark"], result["mode"]) == (name, mode)
    assert result["machine"].keys() >= MACHINE_FIELDS
    assert result["model"]["parameters"] > 0
    figures = result["figures"]
    assert figures and all(f.keys() >= FIGURE_FIELDS for f in figures)
    assert all(isinstance(f["value"], int | float) for f in figures)
    with_goal = [f for f in figures if f["goal"] is not None]
    assert len(with_goal) == goals
    assert all(isinstance(f["met"], bool) for f in with_goal)


def test_engine_throughput_writes_a_complete_result(throughput: Any) -> None:
    assert_complete(*throughput, "engine_throughput", goals=3)


def test_engine_throughput_greedy_outputs_equal_transformers(throughput: Any) -> None:
    _, result = throughput
    checks = result["details"]["greedy_check"]
    assert checks and all(c["equal"] for c in checks)


def test_prefix_cache_writes_a_complete_result(prefix: Any) -> None:
    assert_complete(*prefix, "prefix_cache", goals=1)


def test_prefix_cache_warm_request_computes_only_the_uncached_tail(prefix: Any) -> None:
    _, result = prefix
    workload = result["workload"]
    tail = workload["prompt_len"] - workload["shared_len"]
    for rep in result["details"]["repetitions"]:
        assert rep["cold"]["prompt_tokens_computed"] == workload["prompt_len"]
        assert rep["warm"]["prompt_tokens_computed"] == tail
        assert rep["warm"]["cached_tokens"] == workload["shared_len"]


def test_n_choices_computes_one_prompt_for_four_choices(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    path, result = run_smoke(n_choices.main, demo_model_dir, tmp_path)
    assert_complete(path, result, "n_choices", goals=1)
    assert result["details"]["ratios"]["prefill_tokens_separate_over_n4"] == 4.0
    assert result["details"]["same_tokens_every_repetition"]
