"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.lora.batch import order_by_adapter
from engine.lora.manager import LoraManager
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel, StepContext
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledChunk
from kernels.lora_meta import LoraMetaBuffers
from kernels.paged_attention import AttentionMetadata


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


@dataclass(frozen=True)
class StepInputs:
    chunks: list[ScheduledChunk]
    """The step's chunks in the order they run (grouped by adapter)."""
    input_ids: torch.Tensor
    context: StepContext
    logits_indices: torch.Tensor
    """Row of the final token of each chunk that samples, in chunk order."""

    @property
    def sampling_params(self) -> list[SamplingParams]:
        return [c.seq.params for c in self.chunks if c.samples]

    @property
    def generators(self) -> list[torch.Generator | None]:
        return [c.seq.generator for c in self.chunks if c.samples]


class ModelRunner:
    """Owns the model and the KV pool: `num_blocks` blocks per layer for keys and for values."""

    def __init__(
        self, config: EngineConfig, model: LlamaModel, num_blocks: int, lora: LoraManager | None
    ):
        self.config = config
        self.model = model
        self.lora = lora
        self.device = torch.device(config.device)
        self._lora_buffers = LoraMetaBuffers(config.max_num_batched_tokens, self.device)
        mc = model.config
        shape = (num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=config.torch_dtype, device=self.device),
                torch.zeros(shape, dtype=config.torch_dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]

    def prepare(self, scheduled: list[ScheduledChunk]) -> StepInputs:
        """Order the step's chunks by adapter and flatten them into one token batch."""
        lora = order_by_adapter(scheduled, self.lora, self._lora_buffers)
        chunks = lora.chunks
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
            lora=lora.batch,
        )
        return StepInputs(
            chunks=chunks,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            context=context,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [num sampling chunks, vocab]."""
        hidden = self.model(inputs.input_ids, inputs.context)
        return self.model.compute_logits(hidden[inputs.logits_indices])
