"""The GPU suite's CPU smoke (`--quick`) runs end to end: its gpu tests are found and run (each
skipped here), its benchmarks run on the demo model, and it writes a complete result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_suite
from tests.bench.test_bench_smoke import assert_complete


@pytest.fixture(scope="module")
def suite(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("results")
    path = gpu_suite.main(
        ["--quick", "--model-dir", str(demo_model_dir), "--results-dir", str(out)]
    )
    return path, json.loads(path.read_text())


def test_the_suite_writes_a_complete_result(suite: Any) -> None:
    path, result = suite
    assert_complete(path, result, "gpu_suite", goals=0, mode="quick")


def test_every_gpu_marked_test_file_is_run_and_none_fails(suite: Any) -> None:
    _, result = suite
    tests = result["details"]["tests"]
    assert "tests/engine/test_sampler.py" in tests["files"]
    assert "tests/kernels/test_lora_kernels.py" in tests["files"]
    assert tests["collected"] > 0 and tests["failed"] == []
    assert tests["skipped"] == tests["collected"], "no CUDA here: each gpu test is skipped"


def test_decode_steps_are_set_against_the_bytes_they_read(suite: Any) -> None:
    _, result = suite
    details, workload = result["details"], result["workload"]
    assert [r["batch"] for r in details["roofline"]] == workload["batches"]
    assert all(
        r["step_ms"] > 0 and r["bytes"] > 0 and r["roofline_ms"] > 0 for r in details["roofline"]
    )
    assert set(details["lora"]) == {f"{n}_adapters_ms" for n in (0, *workload["adapter_counts"])}
    assert [r["batch"] for r in details["no_overlap"]] == workload["overlap_batches"]
    assert [r["batch"] for r in details["graphs"]] == workload["graph_batches"]
    assert [r["batch"] for r in details["eager"]] == workload["graph_batches"]


def test_pytest_can_come_from_the_carried_wheels(tmp_path: Path) -> None:
    unpacked = gpu_suite.unpack_wheels(tmp_path)
    assert (unpacked / "pytest" / "__init__.py").is_file()
    assert (unpacked / "_pytest").is_dir() and (unpacked / "pluggy").is_dir()
