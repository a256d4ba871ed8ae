"""The GPU suite's first half: every `gpu`-marked test, run by pytest in a child process (the
installed pytest, or the one carried in bench/wheels), its outcome read from a JUnit report."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.carried_wheels import UNPACKED

ROOT = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "httpx")
"""What the GPU machine has installed (with their dependencies): everything else the suite and
its tests import must travel in bench/wheels (tests/bench/test_gpu_suite_imports.py checks it)."""
TEST_TIMEOUT_S = 180
"""One gpu test's limit, where pytest-timeout is installed."""


@dataclass(frozen=True)
class TestRun:
    files: list[str]
    collected: int
    passed: int
    skipped: int
    failed: list[str]
    """Ids of tests that failed or errored."""
    seconds: float
    pytest: str
    """Where pytest came from: "installed" or "bench/wheels"."""
    output_tail: str


def gpu_test_files() -> list[Path]:
    """Test files holding a `gpu` mark."""
    return sorted(
        p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def run_gpu_tests(timeout_s: int) -> TestRun:
    """Run every `gpu` test in a child process; its outcome, read from a JUnit report."""
    files = [str(p.relative_to(ROOT)) for p in gpu_test_files()]
    with tempfile.TemporaryDirectory(prefix="loramux-gpu-tests-") as tmp:
        paths = [str(ROOT), *([str(UNPACKED)] if UNPACKED else [])]
        source = "installed" if importlib.util.find_spec("pytest") else "bench/wheels"
        env = os.environ | {"PYTHONPATH": os.pathsep.join(paths)}
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "no:tests.redis", "-p", "no:tests.postgres"]
        command += ["-m", "gpu", f"--junitxml={report}", *_parallel_options(), *files]
        started = time.monotonic()
        try:
            proc = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            tail = out.decode(errors="replace") if isinstance(out, bytes) else out
            return TestRun(
                files, 0, 0, 0, [f"timed out after {timeout_s} s"], timeout_s, source, tail[-4000:]
            )
        seconds = time.monotonic() - started
        tail = (proc.stdout + proc.stderr)[-4000:]
        if not report.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}):\n{tail}")
        return _read_junit(report, files, seconds, source, tail)


def _parallel_options() -> list[str]:
    """Where the machine has pytest-timeout and pytest-xdist (the GPU image does): a hung test
    fails alone, and four workers share the kernels' compile time (each test file's tests stay
    on one worker; the GPU is shared, and none of these tests times anything)."""
    options = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        options.append(f"--timeout={TEST_TIMEOUT_S}")
    if importlib.util.find_spec("xdist") is not None and torch.cuda.is_available():
        options += ["-n", "4", "--dist", "loadfile"]
    return options


def _read_junit(report: Path, files: list[str], seconds: float, source: str, tail: str) -> TestRun:
    cases = ET.parse(report).getroot().iter("testcase")
    failed: list[str] = []
    skipped = collected = 0
    for case in cases:
        collected += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
    passed = collected - skipped - len(failed)
    return TestRun(files, collected, passed, skipped, failed, seconds, source, tail)
