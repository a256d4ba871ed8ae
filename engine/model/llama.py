"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache.

Tokens of every sequence in a step are flattened into one `[T]` batch; attention finds each
token's context through the block tables in `StepContext.attention`. Projections are fused
(q|k|v and gate|up) so one GEMM — and one LoRA kernel call — serves each group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from loramux.engine.model.config import ModelConfig
from loramux.engine.model.rope import RotaryEmbedding
from loramux.kernels.paged_attention import AttentionMetadata, paged_attention
from loramux.kernels.rms_norm import rms_norm, rms_norm_torch
from loramux.kernels.rope_cache import rope_and_cache, rope_and_cache_torch


class LoraApplier(Protocol):
    """Each token's adapter, applied in place: the LoRA delta to a projection's output, and
    its embedding weights (if any) to the token embeddings."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def embed(self, input_ids: torch.Tensor, x: torch.Tensor) -> None: ...


@dataclass
class StepContext:
    """Everything a forward pass needs besides the token ids, built once per step."""

    positions: torch.Tensor
    """[T] int64 absolute position of each token."""
    slot_mapping: torch.Tensor
    """[T] int64 KV slot (block * block_size + offset) each token's K/V is written to."""
    attention: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    lora: LoraApplier | None = None


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, optionally adding the residual first (kernels.rms_norm: one
    Triton kernel on CUDA when `fused`)."""

    def __init__(self, size: int, eps: float, fused: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = rms_norm if fused else rms_norm_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)[0]

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        normed, total = self.kernel(x, self.weight, self.eps, residual)
        assert total is not None
        return normed, total


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rope: RotaryEmbedding, fused: bool = True):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, config.o_bias)
        self.rope = rope
        self.rope_and_cache = rope_and_cache if fused else rope_and_cache_torch

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        rope = self.rope
        q = self.rope_and_cache(
            q, k, v, ctx.positions, rope.cos, rope.sin, k_cache, v_cache, ctx.slot_mapping
        )
        attn = paged_attention(q, k_cache, v_cache, ctx.attention, self.scale)
        attn = attn.reshape(-1, self.q_size)
        out = self.o_proj(attn)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer, "o", attn, out)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer, "gate_up", x, gate_up)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        out = self.down_proj(h)
        if ctx.lora is not None:
            ctx.lora.apply(self.layer, "down", h, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rope: RotaryEmbedding, fused: bool = True):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.self_attn = Attention(config, layer, rope, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.mlp = MLP(config, layer)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's MLP output and the residual stream before it (not yet added: the next
        norm adds it, in one kernel with the normalization). `residual` None: x is the first
        layer's input."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h, ctx), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, fused_kernels: bool = True):
        super().__init__()
        self.config = config
        self.rope = rope
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rope, fused_kernels) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """input_ids: [T] → final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if ctx.lora is not None:
            ctx.lora.embed(input_ids, x)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def projection_weight(self, layer: int, proj: str) -> torch.Tensor:
        """The [out, in] weight of one projection (q, k, v, o, gate, up or down) of `layer`: a
        view of its rows in the fused weight."""
        decoder = cast(DecoderLayer, self.layers[layer])
        attn, mlp = decoder.self_attn, decoder.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
        linear, start, end = {
            "q": (attn.qkv_proj, 0, q),
            "k": (attn.qkv_proj, q, q + kv),
            "v": (attn.qkv_proj, q + kv, q + 2 * kv),
            "o": (attn.o_proj, 0, None),
            "gate": (mlp.gate_up_proj, 0, inter),
            "up": (mlp.gate_up_proj, inter, 2 * inter),
            "down": (mlp.down_proj, 0, None),
        }[proj]
        return linear.weight.detach()[start:end]

    def top_weight(self, module: str) -> torch.Tensor:
        """The [vocab, hidden] weight of "embed_tokens" or "lm_head"."""
        linear = self.embed_tokens if module == "embed_tokens" else self.lm_head
        return linear.weight.detach()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
