"""Shared fixtures: the demo model is built once per test session into a temporary folder."""

from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on machines without a CUDA device. This must be set
# before any module decorates a kernel with @triton.jit, hence here, before test modules import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["tests.postgres", "tests.redis"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo-model checkpoint (seed 0), built once per session."""
    from loramux.engine.demo_model import build_demo_model

    out = tmp_path_factory.mktemp("demo-model")
    build_demo_model(out, seed=0)
    return out


@pytest.fixture(scope="session")
def demo_adapter_dirs(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """40 genuine PEFT adapters for the demo model (mixed ranks and targets), built once."""
    from loramux.adapters.demo import build_demo_adapters

    return build_demo_adapters(demo_model_dir, tmp_path_factory.mktemp("demo-adapters"), 40, seed=0)


@pytest.fixture(scope="session")
def overflowing_adapter(
    demo_adapter_dirs: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from tests.adapters.peft_adapters import edit_weights

    """A valid PEFT adapter (finite weights) whose lora_B entries are 1e38: scaled and summed
    in the forward pass they overflow float32, so its requests get infinite and NaN logits."""
    folder = tmp_path_factory.mktemp("overflowing") / "adapter"
    shutil.copytree(demo_adapter_dirs[0], folder)
    edit_weights(
        folder,
        lambda tensors: {
            name: torch.full_like(t, 1e38) if "lora_B" in name else t for name, t in tensors.items()
        },
    )
    return folder
