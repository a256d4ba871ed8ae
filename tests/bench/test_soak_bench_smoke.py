"""The soak benchmark's smallest path runs end to end (a real gateway on loopback, both arms) and
writes a complete result file; what does not depend on timing is checked: no server error, every
request read to its end answered whole, nothing left held afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import soak
from tests.bench.test_bench_smoke import assert_complete


@pytest.fixture(scope="module")
def result(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    threads = torch.get_num_threads()  # the benchmark pins torch's threads; give them back
    out = tmp_path_factory.mktemp("results")
    args = ["--smoke", "--threads", "1", "--model-dir", str(demo_model_dir)]
    path = soak.main([*args, "--results-dir", str(out)])
    torch.set_num_threads(threads)
    return path, json.loads(path.read_text())


def test_writes_a_complete_smoke_result(result: Any) -> None:
    assert_complete(*result, "soak", goals=1)


def test_both_arms_send_the_same_requests_and_get_no_server_error(result: Any) -> None:
    details = result[1]["details"]
    none, leaving = details["no_disconnects"], details["disconnecting"]
    assert none["requests"] == leaving["requests"] > 0 and none["disconnected"] == 0
    for arm in (none, leaving):
        assert arm["server_errors"] == [] and arm["unfinished"] == []


def test_nothing_is_left_held_after_the_soak(result: Any) -> None:
    residue = result[1]["details"]["residue_after"]
    assert residue == {
        "running": 0,
        "waiting": 0,
        "kv_blocks_used": 0,
        "pinned_adapter_slots": 0,
        "open_reservations": {},
    }
