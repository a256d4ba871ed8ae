"""The documented `serve deploy` config is one Ray Serve accepts and names our application."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="the `ray` extra is not installed")
from ray.serve.schema import ServeDeploySchema

from loramux.gateway.ray_app import replicas

CONFIG = Path(__file__).resolve().parents[2] / "docker" / "ray" / "serve_config.yaml"
pytestmark = pytest.mark.ray


def test_the_serve_config_validates_and_its_import_path_is_the_application_builder() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    module, name = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), name))
    assert {replicas(str(v)) for k, v in app.args.items() if k.endswith("_replicas")} <= {2, "auto"}


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5"])
def test_a_replica_count_is_a_positive_integer_or_auto(value: str) -> None:
    with pytest.raises(ValueError):
        replicas(value)
