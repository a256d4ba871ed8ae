"""The gateway overhead benchmark's smallest path runs end to end (an engine process, a real gateway
on loopback connected to it, a load generator process) and writes a complete result file.

Speed is never checked against its goal here; what does not depend on timing is: both arms run the
same requests and produce the same tokens, every load request is answered 200.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gateway_overhead

FIGURE_FIELDS = {"name", "value", "unit", "goal", "met"}


@pytest.fixture(scope="module")
def result(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    threads = torch.get_num_threads()  # the benchmark pins torch's threads; give them back
    out = tmp_path_factory.mktemp("results")
    args = ["--smoke", "--threads", "1", "--model-dir", str(demo_model_dir)]
    path = gateway_overhead.main([*args, "--results-dir", str(out)])
    torch.set_num_threads(threads)
    yield path, json.loads(path.read_text())


def test_writes_a_complete_smoke_result(result: Any) -> None:
    path, data = result
    assert path.name == "gateway_overhead-smoke.json"
    assert (data["benchmark"], data["mode"]) == ("gateway_overhead", "smoke")
    assert {"machine", "model", "workload", "settings", "figures", "details"} <= data.keys()
    assert data["settings"]["enable_prefix_caching"] == "False"
    figures = data["figures"]
    assert all(f.keys() >= FIGURE_FIELDS for f in figures)
    assert all(isinstance(f["value"], int | float) for f in figures)


def test_goals_bound_added_ttft_and_the_engines_step_rate(result: Any) -> None:
    _, data = result
    streams = data["workload"]["concurrency"]
    with_goal = {f["name"]: f for f in data["figures"] if f["goal"] is not None}
    assert {name: f["goal"] for name, f in with_goal.items()} == {
        "time to first token p50, added, 1 stream": "<= 2",
        f"time to first token p50, added / direct, {streams} streams": "<= 0.1",
        f"engine steps per second, gateway / direct, {streams} streams": ">= 0.9",
    }
    for figure in with_goal.values():
        relation, bound = figure["goal"].split()
        value = figure["value"]
        assert figure["met"] == (
            value <= float(bound) if relation == "<=" else value >= float(bound)
        )


def test_both_arms_run_the_same_requests_to_the_same_tokens(result: Any) -> None:
    _, data = result
    workload, details = data["workload"], data["details"]
    gateway, direct = details["gateway_arm"], details["direct_arm"]
    requests = workload["windows"] * workload["requests_per_window"]
    assert gateway["requests"] == direct["requests"] == requests
    assert gateway["completion_tokens"] == direct["completion_tokens"] > 0
    assert gateway["client_cpu_seconds"] > 0 and direct["client_cpu_seconds"] > 0
    assert gateway["engine_steps"] > 0 and direct["engine_steps"] > 0


def test_every_load_request_is_answered(result: Any) -> None:
    details = result[1]["details"]
    for name in ("noop_round_trip", "models_rate", "health_rate"):
        assert details[name]["requests"] > 0
        assert details[name]["errors"] == 0


def test_the_profile_lists_the_gateway_loops_costliest_functions(result: Any) -> None:
    profile = result[1]["details"]["profile"]
    top = profile["top_by_own_time"]
    assert profile["requests"] > 0 and top
    assert all(row["own_us_per_request"] >= 0 and row["function"] for row in top)
