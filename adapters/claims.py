"""Claims on adapter digests that hold across processes: the gateway workers of one host share an
adapter store, and one worker's cleanup must not remove the files of a digest that another
worker is publishing (two tenants uploading identical bytes, or a version deleted while the same
bytes are published again).

A publish claims its digest from its put until its row is committed (shared: any number of
publishes of the same bytes at once); a cleanup (a failed publish undoing itself, a delete
retiring a digest) waits its turn among cleanups of the digest (`try_cleanup`), then goes ahead
only while no one claims the digest, and holds everyone off until it has decided and acted
(exclusive, never waiting: a claimed digest is simply left alone, its publisher takes care of
it). A claim is a flock(2) lock on `<root>/.claims/<digest>`, so a
process that dies drops its claims with it. The lock files stay (a few bytes per digest ever
published): removing one while another process opens it would split the lock in two.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

_DIGEST = re.compile(r"[0-9a-f]{64}")


class Claim:
    """A held claim on one digest; released on `release` or on leaving its `with`."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops its lock
            self._fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class DigestClaims:
    def __init__(self, root: Path):
        self.folder = Path(root) / ".claims"
        self.folder.mkdir(parents=True, exist_ok=True)

    def claim(self, digest: str) -> Claim:
        """A claim on `digest` (shared with other publishes of it); blocks while a cleanup of
        the digest is deciding."""
        fd = self._open(digest)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return Claim(fd)

    def try_claim(self, digest: str) -> Claim | None:
        """A claim on `digest`, or None while a cleanup of it is deciding. Never waits: an
        event loop retries it (a thread blocked on the lock would be one fewer for the
        cleanup, which may need one to finish)."""
        return self._try(digest, "", fcntl.LOCK_SH)

    def try_cleanup(self, digest: str) -> Claim | None:
        """The right to clean `digest` up, or None while another cleanup of it (in any process)
        has it; never waits. Cleanups of one digest take turns, each deciding on what it reads
        after the one before ended: a cleanup that found the digest locked used to take it for
        a publish and leave it, though it was another cleanup, which had decided on an older
        read (two tenants deleting identical adapters at once left the files for good)."""
        return self._try(digest, ".cleanup", fcntl.LOCK_EX)

    def _try(self, digest: str, suffix: str, mode: int) -> Claim | None:
        """The lock file `<digest><suffix>` locked in `mode` without waiting; None when taken."""
        fd = self._open(digest, suffix)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return Claim(fd)

    @contextlib.contextmanager
    def unclaimed(self, digest: str) -> Iterator[bool]:
        """Whether no one claims `digest` now; when True, no one can until the block ends.
        Never waits."""
        fd = self._open(digest)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
            else:
                yield True
        finally:
            os.close(fd)

    def _open(self, digest: str, suffix: str = "") -> int:
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"{digest!r} is not an adapter digest")
        path = self.folder / f"{digest}{suffix}"
        try:
            return os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        except FileNotFoundError:  # the folder was removed (an operator cleaning up): again
            self.folder.mkdir(parents=True, exist_ok=True)
            return os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
