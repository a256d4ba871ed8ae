"""PEFT serving the same requests as the engine, the reference of bench.lora_batching: mixed
adapters in one static batch (`generate(adapter_names=...)`), or one adapter at a time
(`set_adapter`); greedy, left-padded, exactly `out_len` tokens each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from bench.adapter_requests import Request, Run
from bench.common import now


def load_peft(model_dir: Path, folders: Sequence[Path], dtype: torch.dtype, device: str) -> Any:
    """One PeftModel holding every adapter in `folders`, each named by its folder."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, folders[0], adapter_name=folders[0].name)
    for folder in folders[1:]:
        model.load_adapter(folder, adapter_name=folder.name)
    return model.to(device).eval()


@dataclass(frozen=True)
class Peft:
    model: Any
    names: list[str]
    """Adapter index → PEFT adapter name."""
    out_len: int
    pad_id: int

    def generate(self, prompts: Sequence[list[int]], names: list[str] | None) -> list[list[int]]:
        """Greedy continuations of exactly `out_len` tokens, left-padded; row i on adapter
        `names[i]`, or every row on the active adapter when `names` is None."""
        width = max(len(p) for p in prompts)
        pad, device = self.pad_id, self.model.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        extra = {} if names is None else {"adapter_names": names}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=self.out_len,
                do_sample=False,
                eos_token_id=None,  # transformers 5: None turns stopping at EOS off
                pad_token_id=pad,
                **extra,
            )
        assert out.shape[1] == width + self.out_len, "generate stopped early: EOS still on"
        return out[:, width:].tolist()

    def run_mixed(self, requests: Sequence[Request], batch: int) -> Run:
        """Static batches of `batch` requests in submission order, each row on its adapter."""
        outputs: list[list[int]] = []
        start = now(str(self.model.device))
        for i in range(0, len(requests), batch):
            chunk = requests[i : i + batch]
            rows = [self.names[r.adapter] if r.adapter is not None else "__base__" for r in chunk]
            outputs += self.generate([r.prompt for r in chunk], rows)
        return now(str(self.model.device)) - start, outputs

    def run_per_adapter(self, requests: Sequence[Request]) -> Run:
        """For each adapter in order of first use: `set_adapter`, one batch of its requests."""
        groups: dict[int | None, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.adapter, []).append(i)
        outputs: list[list[int]] = [[] for _ in requests]
        start = now(str(self.model.device))
        for adapter, rows in groups.items():
            assert adapter is not None, "the per-adapter way serves adapter requests only"
            self.model.set_adapter(self.names[adapter])
            got = self.generate([requests[i].prompt for i in rows], None)
            for i, tokens in zip(rows, got, strict=True):
                outputs[i] = tokens
        return now(str(self.model.device)) - start, outputs
