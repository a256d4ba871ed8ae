"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.lora.batch import order_by_adapter
from engine.lora.manager import LoraManager
from engine.model.config import ModelConfig
from engine.model.llama import LlamaModel
from engine.scheduler import ScheduledChunk
from engine.step_inputs import LaunchedStep, StepBuffers, StepInputs
from kernels.lora_meta import LoraMetaBuffers


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


class ModelRunner:
    """Owns the model, the KV pool (`num_blocks` blocks per layer for keys and for values) and
    the preallocated per-step buffers."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        num_blocks: int,
        max_model_len: int,
        lora: LoraManager | None,
    ):
        self.config = config
        self.model = model
        self.lora = lora
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
        max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks_per_seq,
            mc.vocab_size,
            self.device,
        )
        self._lora_buffers = LoraMetaBuffers(config.max_num_batched_tokens, self.device)

    def prepare(
        self, scheduled: list[ScheduledChunk], previous: LaunchedStep | None = None
    ) -> StepInputs:
        """Order the step's chunks by adapter and write them into the step buffers; tokens
        still pending come from `previous`'s sampled ids, on the device."""
        lora = order_by_adapter(scheduled, self.lora, self._lora_buffers)
        bs = self.config.block_size
        return self.buffers.fill(lora.chunks, bs, self.kv_caches, lora.batch, previous)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [num sampling chunks, vocab]."""
        hidden = self.model(inputs.input_ids, inputs.context)
        return self.model.compute_logits(hidden[inputs.logits_indices])
