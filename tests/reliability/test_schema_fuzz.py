"""schemathesis against the running gateway's own OpenAPI schema, with a tenant's API key and with
an admin token: whatever it generates (valid and invalid parameters and bodies), the gateway
never answers with a 5xx (`not_a_server_error`). Bounded by examples per operation and time."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from loramux.gateway.server import RunningServer
from tests.reliability.rig import admin_client, make_tenants

SEED = "20261123"
MAX_EXAMPLES = "20"
MAX_SECONDS = "15"
"""Each of the two runs stops after this long at the latest."""


def schemathesis() -> str:
    beside = Path(sys.executable).parent / "schemathesis"
    found = str(beside) if beside.is_file() else shutil.which("schemathesis")
    assert found, "schemathesis is not installed (pip install -e '.[dev]')"
    return found


def fuzz(gateway: RunningServer, token: str, paths: str, report: Path) -> None:
    command = [
        schemathesis(),
        "run",
        f"{gateway.url}/schema/openapi.json",
        "--checks",
        "not_a_server_error",
        "--header",
        f"Authorization: Bearer {token}",
        "--include-path-regex",
        paths,
        "--max-examples",
        MAX_EXAMPLES,
        "--max-time",
        MAX_SECONDS,
        "--seed",
        SEED,
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--no-shrink",
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
    ]
    # Run from the test's folder: schemathesis keeps a cache in `.schemathesis/` of its cwd.
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=report.parent)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_no_generated_api_request_gets_a_server_error(
    gateway: RunningServer, adapter_dirs: list[Path], tmp_path: Path
) -> None:
    with admin_client(gateway) as admin:
        [tenant] = make_tenants(admin, 1, adapter_dirs)
    fuzz(gateway, tenant.key, "^/v1/", tmp_path / "api.xml")


def test_no_generated_admin_request_gets_a_server_error(
    gateway: RunningServer, tmp_path: Path
) -> None:
    token = gateway.state.admin.mint("schemathesis", ttl_seconds=600)
    fuzz(gateway, token, "^/admin/", tmp_path / "admin.xml")
