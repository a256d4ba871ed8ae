"""Engine configuration: one frozen dataclass, validated on construction.

It imports no torch: the gateway's settings (gateway.settings) take their engine defaults from
here in processes that never run a model, such as the `loramux` command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
MAX_CPU_THREADS = 4096
"""More threads than any machine has cores: a larger count is a mistake (torch cannot even take
one past 2**31 - 1)."""


@dataclass(frozen=True)
class EngineConfig:
    model: Path
    """A local Hugging Face folder of a Llama-family model."""
    random_weights: bool = False
    """Give the model seeded random weights instead of reading the folder's (which then needs
    only config.json and the tokenizer): benchmarks of shapes that exist only as a config."""
    dtype: str = "float32"
    """Weights and activations: float32, float16 or bfloat16."""
    device: str = "cpu"
    """torch device; CUDA uses the Triton kernels, CPU the torch twins."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = 256 * 1024 * 1024
    """Memory budget for the KV-cache pool (keys and values of every layer) and, on CUDA, the
    decode graphs' memory."""
    num_kv_blocks: int | None = None
    """Exact pool size in blocks; overrides `kv_cache_bytes` (tests use it to force preemption)."""
    max_num_seqs: int = 64
    """Cap on sequences running in one step."""
    max_num_batched_tokens: int = 512
    """Token budget per step, shared by decode tokens and prefill chunks."""
    max_model_len: int | None = None
    """Longest prompt plus completion; defaults to the model's context length."""
    max_waiting: int = 4096
    """Requests queued beyond `max_num_seqs` running ones are refused with
    EngineOverloadedError; a full queue is shared between owners (engine.queue_share)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes (same tokens, same adapter)."""
    enable_lora: bool = True
    """Serve LoRA adapters; False allocates no adapter slots."""
    max_loras: int = 64
    """Adapters resident on the device at once at most (rows of the kernels' tables, cheap), so
    also distinct adapters in one step; how many fit is up to `lora_memory_bytes`."""
    lora_memory_bytes: int | None = None
    """Device memory for resident adapters' weights, each held at its own ranks. None: room for
    min(`max_loras`, 8) adapters of `max_lora_rank` on every projection; adapters of smaller
    ranks or fewer targets fit more."""
    max_cpu_loras: int = 64
    """Adapters kept parsed in host memory (the tier between disk and device slots)."""
    max_lora_rank: int = 64
    """Largest adapter rank accepted (up to 256); slots are sized for it."""
    lora_load_workers: int | None = None
    """Threads reading adapters from disk in parallel; None: the cores, at most 4."""
    lora_copy_groups_per_step: int = 8
    """On the CPU, (layer, projection group) blocks of adapter weights copied into device slots
    per step, so one big adapter never stalls a step (its requests run on the host path while
    it copies). On CUDA copies run on a side stream and this is unused."""
    cuda_graphs: bool = True
    """On CUDA, decode steps replay captured CUDA graphs (a ladder of batch sizes up to
    max_num_seqs; their memory counts in `kv_cache_bytes`). LORAMUX_CUDA_GRAPHS=0 turns it off."""
    fused_kernels: bool = True
    """On CUDA, the residual add with RMSNorm and rotary embedding with the KV cache write run as
    fused Triton kernels (kernels.rms_norm, kernels.rope_cache); False runs their torch forms,
    as the CPU always does. LORAMUX_FUSED_KERNELS=0 turns them off."""
    async_scheduling: bool | None = None
    """Schedule and prepare step N + 1 while the device computes step N. None: where the
    device runs asynchronously (CUDA); True: anywhere (on the CPU the same code runs without
    any overlap, which tests use); False: never."""
    cpu_threads: int | None = None
    """torch's intra-op threads in a process that is the engine's own (`loramux engine`): on a
    CPU device, the cores the model runs on. None: torch's default, every core. `loramux serve`
    gives its engine the cores its gateway workers leave (gateway.engine_child)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be at least 0, not {self.max_waiting}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.max_loras < 1 or self.max_cpu_loras < 1:
            raise ValueError("max_loras and max_cpu_loras must be at least 1")
        if self.lora_memory_bytes is not None and self.lora_memory_bytes < 1:
            raise ValueError("lora_memory_bytes must be positive")
        if self.lora_load_workers is not None and self.lora_load_workers < 1:
            raise ValueError("lora_load_workers must be at least 1")
        if self.lora_copy_groups_per_step < 1:
            raise ValueError("lora_copy_groups_per_step must be at least 1")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= MAX_CPU_THREADS:
            raise ValueError(
                f"cpu_threads must be within 1..{MAX_CPU_THREADS}, not {self.cpu_threads}"
            )
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_lora_rank must be within 1..256, not {self.max_lora_rank}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
