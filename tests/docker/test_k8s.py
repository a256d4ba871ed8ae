"""The KubeRay RayService manifest is valid against the RayService CRD's schema (KubeRay v1.7,
vendored in tests/fixtures/kuberay) with check-jsonschema, strictly: a field the CRD does not
define is an error, as `kubectl apply --validate=strict` makes it. Its Serve config is the one
docker/ray/serve_config.yaml documents, and the cluster gives each engine replica a GPU."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).parents[2]
MANIFEST = REPO / "docker" / "k8s" / "rayservice.yaml"
SERVE_CONFIG = REPO / "docker" / "ray" / "serve_config.yaml"
CRD_SCHEMA = REPO / "tests" / "fixtures" / "kuberay" / "rayservice-v1.json"


def strict(schema: Any) -> Any:
    """The CRD's structural schema with unknown fields refused: every object schema that lists
    its properties and neither keeps unknown fields nor says what else it allows gets
    `additionalProperties: false` (the API server would silently drop such fields)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def validate(manifest: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    schema = tmp_path / "rayservice.schema.json"
    schema.write_text(json.dumps(strict(json.loads(CRD_SCHEMA.read_text()))))
    document = tmp_path / "rayservice.yaml"
    document.write_text(yaml.safe_dump(manifest))
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), str(document)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def test_the_rayservice_manifest_is_valid_against_the_crd(tmp_path: Path) -> None:
    result = validate(manifest(), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "rayClusterConfig", "workerGroupSpec"), []),  # a misspelt field
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"), "one"),
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "num-cpus"), 2),
    ],
)
def test_the_validation_refuses_what_the_crd_does_not_allow(
    tmp_path: Path, path: tuple[str | int, ...], value: Any
) -> None:
    broken = copy.deepcopy(manifest())
    node: Any = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert validate(broken, tmp_path).returncode != 0


def test_the_serve_config_is_the_documented_application() -> None:
    serve_config = yaml.safe_load(manifest()["spec"]["serveConfigV2"])
    documented = yaml.safe_load(SERVE_CONFIG.read_text())
    assert serve_config["applications"] == documented["applications"]
    ray_schema = pytest.importorskip("ray.serve.schema", reason="the `ray` extra is not installed")
    ray_schema.ServeDeploySchema.model_validate(serve_config)


def test_each_engine_worker_has_a_gpu_and_every_pod_reads_the_settings_secret() -> None:
    cluster = manifest()["spec"]["rayClusterConfig"]
    (gpu,) = cluster["workerGroupSpecs"]
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    pods = [cluster["headGroupSpec"]["template"], gpu["template"]]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert {"secretRef": {"name": "loramux-settings"}} in container["envFrom"]
    (worker,) = gpu["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cluster["rayVersion"] == _ray_pin()


def _ray_pin() -> str:
    """The ray version the `ray` extra pins in pyproject.toml."""
    text = (REPO / "pyproject.toml").read_text()
    return text.split("ray[serve]==", 1)[1].split('"', 1)[0]
