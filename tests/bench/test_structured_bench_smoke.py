"""The structured-outputs benchmark's smoke path runs end to end and writes a complete result
(figures are reported, never checked against their goal)."""

from __future__ import annotations

from pathlib import Path

from bench import structured_outputs
from tests.bench.test_bench_smoke import assert_complete, run_smoke


def test_structured_outputs_writes_a_complete_result(demo_model_dir: Path, tmp_path: Path) -> None:
    path, result = run_smoke(structured_outputs.main, demo_model_dir, tmp_path)
    assert_complete(path, result, "structured_outputs", goals=2)
    assert {t["constrained"] for t in result["details"]["timings"]} == {True, False}
