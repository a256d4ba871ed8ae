"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel, LoraApplier, StepContext
from engine.scheduler import ScheduledChunk
from kernels.paged_attention import AttentionMetadata


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    context: StepContext
    logits_indices: torch.Tensor
    """Row of the final token of each chunk that samples, in chunk order."""


class ModelRunner:
    """Owns the model and the KV pool: `num_blocks` blocks per layer for keys and for values."""

    def __init__(self, config: EngineConfig, model: LlamaModel, num_blocks: int):
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        mc = model.config
        shape = (num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=config.torch_dtype, device=self.device),
                torch.zeros(shape, dtype=config.torch_dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]

    def prepare(self, chunks: list[ScheduledChunk], lora: LoraApplier | None = None) -> StepInputs:
        """Flatten the step's chunks into one token batch."""
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        q_lens, seq_lens, tables = [], [], []
        for chunk in chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
        dev = self.device
        context = StepContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            attention=AttentionMetadata.build(q_lens, seq_lens, tables, device=dev),
            kv_caches=self.kv_caches,
            lora=lora,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            context=context,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [num sampling chunks, vocab]."""
        hidden = self.model(inputs.input_ids, inputs.context)
        return self.model.compute_logits(hidden[inputs.logits_indices])
