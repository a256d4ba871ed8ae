"""Another process holding a claim on a digest (adapters.claims), as another gateway worker
publishing the same bytes does."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HOLDER = """
import sys
from pathlib import Path
from loramux.adapters.claims import DigestClaims
claim = DigestClaims(Path(sys.argv[1])).claim(sys.argv[2])
print("claimed", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def claim_held_elsewhere(root: Path, digest: str) -> Iterator[subprocess.Popen[str]]:
    """A child process holding a claim on `digest` in the store at `root` until its stdin closes
    (or it is killed, at the latest on exit)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), digest],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "claimed"
        yield child
    finally:
        child.kill()
        child.wait(30)
