"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits.

Decode steps replay captured CUDA graphs where they can (engine.cuda_graphs); every other step
runs eagerly over the same preallocated step buffers.
"""

from __future__ import annotations

import logging

import torch

from loramux.engine.config import EngineConfig
from loramux.engine.cuda_graphs import DecodeGraphs, graph_batches
from loramux.engine.lora.batch import LoraBatch, needs_eager, order_by_adapter
from loramux.engine.lora.manager import LoraManager
from loramux.engine.model.config import ModelConfig
from loramux.engine.model.llama import LlamaModel
from loramux.engine.scheduler import ScheduledChunk
from loramux.engine.sequence import BASE_ADAPTER
from loramux.engine.step_inputs import LaunchedStep, StepBuffers, StepInputs
from loramux.kernels.lora_meta import LoraMetaBuffers

log = logging.getLogger(__name__)


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of every layer for one block."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * element


def kv_pool_blocks(
    config: EngineConfig, model: ModelConfig, max_model_len: int, graph_bytes: int
) -> int:
    """Blocks in the KV pool: `num_kv_blocks`, or what the KV budget holds once the decode
    graphs' memory (`graph_bytes`) is counted in it. Raises ValueError when that is less than
    one sequence of `max_model_len`."""
    per_block = kv_bytes_per_block(model, config.block_size, config.torch_dtype)
    num_blocks = config.num_kv_blocks or max(0, config.kv_cache_bytes - graph_bytes) // per_block
    needed = -(-max_model_len // config.block_size)
    if num_blocks < needed:
        graphs = f" after the decode graphs' {graph_bytes >> 20} MiB" if graph_bytes else ""
        raise ValueError(
            f"the KV pool ({num_blocks} blocks of {config.block_size}{graphs}) cannot hold one "
            f"sequence of max_model_len {max_model_len}; raise the KV budget or lower "
            "max_model_len"
        )
    return num_blocks


class ModelRunner:
    """Owns the model, the KV pool, the preallocated per-step buffers and the decode graphs.

    The KV pool holds the block manager's `num_blocks` blocks per layer, for keys and for
    values, plus one padding block (id `num_blocks`) that padded graph rows write and read.
    Until `allocate_kv` sizes it, the pool is the padding block alone.
    """

    def __init__(
        self, config: EngineConfig, model: LlamaModel, max_model_len: int, lora: LoraManager | None
    ):
        self.config = config
        self.model = model
        self.lora = lora
        self.device = torch.device(config.device)
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        use_graphs = config.cuda_graphs and self.device.type == "cuda"
        max_batch = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.graph_batches = graph_batches(max_batch) if use_graphs else ()
        self.graphs: DecodeGraphs | None = None
        self._lora_buffers = LoraMetaBuffers(config.max_num_batched_tokens, self.device)
        self.allocate_kv(0)

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the KV pool for `num_blocks` blocks (and the padding block), the step
        buffers, and capture the decode graphs over them."""
        self.graphs = None
        c, mc = self.config, self.model.config
        shape = (num_blocks + 1, c.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=c.torch_dtype, device=self.device),
                torch.zeros(shape, dtype=c.torch_dtype, device=self.device),
            )
            for _ in range(mc.num_layers)
        ]
        self.buffers = StepBuffers(
            c.max_num_batched_tokens,
            c.max_num_seqs,
            self.max_blocks_per_seq,
            mc.vocab_size,
            padding_block=num_blocks,
            device=self.device,
        )
        if num_blocks and self.graph_batches:
            variants = (True, False) if self.lora is not None else (False,)
            self.graphs = DecodeGraphs.capture(
                self.graph_batches, variants, self._prepare_padding, self._forward_padded
            )

    def graph_memory(self) -> int:
        """Bytes the decode graphs will hold: the peak of one eager forward pass of the largest
        graph batch (what its captured allocations come to), over padding rows only."""
        if not self.graph_batches:
            return 0
        batch = max(self.graph_batches)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._prepare_padding(batch, self.lora is not None)
        self._forward_padded(batch)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def prepare(
        self,
        scheduled: list[ScheduledChunk],
        previous: LaunchedStep | None = None,
        pad_to: int | None = None,
    ) -> StepInputs:
        """Order the step's chunks by adapter and write them into the step buffers; tokens
        still pending come from `previous`'s sampled ids, on the device. A step of one-token
        chunks is padded to `pad_to` rows, by default to the batch of the smallest captured
        graph that holds it (if any)."""
        one_token = all(c.num_tokens == 1 for c in scheduled)
        graphs = self.graphs if pad_to is None and one_token else None
        # Python LoRA work (the host path, embedding weights) is not in a graph; checked last.
        if graphs is not None and not needs_eager(scheduled, self.lora):
            pad_to = graphs.batch_for(len(scheduled))
        bs = self.config.block_size
        # A step without an adapter runs (or replays) the model without LoRA kernels, and builds
        # no LoRA batch (a padded one would have one: a graph's kernels read its tables).
        if all(c.seq.adapter_id == BASE_ADAPTER for c in scheduled):
            return self.buffers.fill(scheduled, bs, self.kv_caches, None, previous, pad_to)
        lora = order_by_adapter(scheduled, self.lora, self._lora_buffers, pad_to)
        return self.buffers.fill(lora.chunks, bs, self.kv_caches, lora.batch, previous, pad_to)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the KV of each (source, destination) block, in every layer, on the device's
        stream: after the steps already queued, before the next forward pass."""
        if not copies:
            return
        source, destination = (
            torch.tensor(c, device=self.device) for c in zip(*copies, strict=True)
        )
        for keys, values in self.kv_caches:
            keys[destination] = keys[source]
            values[destination] = values[source]

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """float32 logits [num sampling chunks, vocab]: the captured graph of the step's batch
        replayed, or the model run eagerly (padding rows too, if any)."""
        if self.graphs is not None and inputs.graph_batch in self.graphs.batches:
            hidden = self.graphs.replay(inputs.graph_batch, inputs.context.lora is not None)
        else:
            hidden = self.model(inputs.input_ids, inputs.context)
        sampled = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(sampled)
        if isinstance(inputs.context.lora, LoraBatch) and inputs.context.lora.top:
            with torch.inference_mode():  # the logits are an inference tensor
                inputs.context.lora.adjust_logits(inputs.logits_indices, sampled, logits)
        return logits

    def _prepare_padding(self, batch: int, with_lora: bool) -> None:
        """Step buffers holding `batch` padding rows and nothing else, as graphs are captured
        (with the LoRA kernels or without)."""
        lora = order_by_adapter([], self.lora, self._lora_buffers, batch).batch
        bs = self.config.block_size
        self._padded = self.buffers.fill(
            [], bs, self.kv_caches, lora if with_lora else None, None, batch
        )

    def _forward_padded(self, batch: int) -> torch.Tensor:
        """The model over the step buffers' first `batch` rows: what a graph captures."""
        inputs = self._padded
        assert inputs.graph_batch == batch
        return self.model(inputs.input_ids, inputs.context)
