"""Every Triton kernel compiles for an H100 (sm_90) here, without a GPU: the GPU compiler and
ptxas reject what the interpreter accepts (tl.dot under 16 rows, say) before a lent GPU finds it.
The compiles run in a child process without TRITON_INTERPRET (tests/kernels/compile_for_gpu.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_for_gpu", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_kernel_compiles_for_sm90_at_serving_shapes_in_every_dtype() -> None:
    done = _run()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.startswith("compiled ")]
    kernels = {line.split()[1].split("[")[0] for line in compiled}
    assert kernels == {
        "rms_norm", "rope_cache", "paged_attention", "bgmv_expand", "sgmv_expand", "bgmv_shrink",
        "sgmv_shrink",
    }  # fmt: skip
    assert len(compiled) == 51


def test_a_kernel_the_gpu_compiler_refuses_fails_the_check() -> None:
    done = _run("--must-fail")
    assert done.returncode == 1 and "refused as expected" in done.stdout, done.stderr[-3000:]
