"""The GPU suite's CPU smoke (`--quick`) runs end to end: its gpu tests are found and run (each
skipped here), its benchmarks run on the demo model, and it writes a complete result."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest

from bench import carried_wheels, gpu_suite
from bench.decode_steps import time_decode
from bench.lora_overhead import write_adapter
from loramux.adapters.base_spec import BaseModelSpec
from loramux.engine.llm_engine import LLMEngine
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
    assert [r["batch"] for r in details["unfused"]] == workload["overlap_batches"]
    assert [r["batch"] for r in details["graphs"]] == workload["graph_batches"]
    assert [r["batch"] for r in details["eager"]] == workload["graph_batches"]


def test_pytest_can_come_from_the_carried_wheels(tmp_path: Path) -> None:
    wheels = sorted(gpu_suite.WHEELS.glob("*.whl"))
    assert {carried_wheels.distribution(w) for w in wheels} >= {"pytest", "pluggy", "llguidance"}
    unpacked = carried_wheels.unpack(wheels, tmp_path)
    assert (unpacked / "pytest" / "__init__.py").is_file()
    assert (unpacked / "_pytest").is_dir() and (unpacked / "pluggy").is_dir()


def test_only_wheels_of_what_is_not_installed_are_unpacked(tmp_path: Path) -> None:
    assert carried_wheels.missing_wheels() == [], "the dev environment has every carried package"
    fake = tmp_path / "loramux_absent_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr("loramux_absent_pkg/__init__.py", "")
    shutil.copy(gpu_suite.WHEELS / "pluggy-1.7.0-py3-none-any.whl", tmp_path)
    assert carried_wheels.missing_wheels(tmp_path) == [fake]


def test_a_timing_of_fewer_running_requests_than_asked_is_refused(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    """The suite's engine holds every adapter of its largest count at once, so the timed steps
    of 64 requests on 64 adapters run all 64; with memory for one adapter, requests on four
    take turns and `time_decode` refuses to report the smaller batch's time as the larger's."""
    settings, _ = gpu_suite.parse_args(["--quick", "--model-dir", str(demo_model_dir)])
    w = dataclasses.replace(gpu_suite.WORKLOADS["quick"], adapter_counts=(4,))
    config = gpu_suite.engine_config(settings, demo_model_dir, w)
    base = BaseModelSpec.from_model_dir(demo_model_dir)
    folders = [write_adapter(tmp_path / f"a{i}", base, 16, seed=i, device="cpu") for i in range(4)]
    one_adapter = config.lora_memory_bytes // 4  # type: ignore[operator]
    for memory, runs_all in ((config.lora_memory_bytes, True), (one_adapter, False)):
        engine = LLMEngine(dataclasses.replace(config, lora_memory_bytes=memory))
        digests = [engine.register_adapter(f) for f in folders]
        if runs_all:
            timing = time_decode(engine, digests, 8, 1, 2, random.Random(0))
            assert timing.running == timing.batch == 4
        else:
            with pytest.raises(RuntimeError, match="ran 1 of 4 requests"):
                time_decode(engine, digests, 8, 1, 2, random.Random(0))
        engine.lora.shutdown()  # type: ignore[union-attr]
