"""Claims on digests hold across processes (adapters.claims): a claim held by another process
keeps a cleanup off the digest, its death releases it, and a publish's claim waits for a cleanup
that is deciding."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loramux.adapters.claims import DigestClaims
from tests.adapters.claim_holder import claim_held_elsewhere

DIGEST = "ab" * 32


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding a claim on DIGEST until its stdin closes."""
    with claim_held_elsewhere(tmp_path, DIGEST) as child:
        yield child


def test_a_digest_another_process_claims_is_not_free_until_that_claim_ends(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    claims = DigestClaims(tmp_path)
    with claims.unclaimed(DIGEST) as free:
        assert not free
    with claims.unclaimed("cd" * 32) as free:
        assert free, "other digests are free"
    with claims.claim(DIGEST):  # publishes of the same bytes share it
        pass
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(30)
    with claims.unclaimed(DIGEST) as free:
        assert free


def test_a_claimant_killed_outright_releases_its_claim(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    with DigestClaims(tmp_path).unclaimed(DIGEST) as free:
        assert free


def test_a_claim_waits_for_a_cleanup_deciding_and_then_holds_off_the_next(tmp_path: Path) -> None:
    claims = DigestClaims(tmp_path)
    claimed = threading.Event()

    def publish() -> None:
        with claims.claim(DIGEST):
            claimed.set()
            release.wait(30)

    release = threading.Event()
    publisher = threading.Thread(target=publish)
    with claims.unclaimed(DIGEST) as free:
        assert free
        publisher.start()
        assert not claimed.wait(0.3), "a claim is taken while a cleanup decides"
    assert claimed.wait(30)
    with claims.unclaimed(DIGEST) as free:
        assert not free
    release.set()
    publisher.join(30)


def test_only_digests_name_claims(tmp_path: Path) -> None:
    claims = DigestClaims(tmp_path)
    for bad in ("../etc/passwd", "AB" * 32, "ab" * 31, ""):
        with pytest.raises(ValueError):
            claims.claim(bad)
        with pytest.raises(ValueError), claims.unclaimed(bad):
            pass


def test_claims_survive_their_folder_being_removed(tmp_path: Path) -> None:
    """An operator cleaning up removes `.claims`: claims and cleanups go on (every upload and
    delete failed with a 500 until the process restarted)."""
    claims = DigestClaims(tmp_path)
    shutil.rmtree(claims.folder)
    with claims.claim(DIGEST), claims.unclaimed(DIGEST) as free:
        assert not free
    shutil.rmtree(claims.folder)
    with claims.unclaimed(DIGEST) as free:
        assert free
    shutil.rmtree(claims.folder)
    claim = claims.try_claim(DIGEST)
    assert claim is not None
    claim.release()
