"""The content digest that names an adapter inside the engine, caches and the store.

digest = sha256(
    canonical JSON of the normalized config (only fields that change the math) + "\\n"
    then, for each weight in sorted canonical-name order:
        canonical JSON of [name, dtype, shape] + "\\n" + the tensor's raw little-endian bytes
)

It depends only on the math: saving the same adapter twice (other file layout, metadata or
key prefix) gives the same digest; any change to a weight's value, dtype or shape, to the
rank, alpha, rsLoRA flag or targeted modules gives a new one. The header line fixes each
tensor's byte length, so the concatenation is unambiguous.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII only: one byte string per value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def adapter_digest(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> str:
    """Hex sha256 of a normalized config and named weights (see the module docstring)."""
    hasher = hashlib.sha256(canonical_json(dict(config)) + b"\n")
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        hasher.update(canonical_json([name, dtype, list(tensor.shape)]) + b"\n")
        hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
