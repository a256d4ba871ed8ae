"""Decode-step measurements for the GPU suite (bench.gpu_suite): the engine's step time with B
requests decoding, the bytes such a step must read at least, and the models and adapters the
suite runs on.

A measurement adds B requests, steps until each has its first token and a few steps more, then
times a run of decode steps with the device synchronized only at both ends, so asynchronous
scheduling overlaps the host's work with the device's as it does in serving. Its requests are
then aborted and the engine drained.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.common import now
from engine.config import EngineConfig
from engine.demo_model import END_OF_TEXT_ID, EOS_TOKEN_IDS
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.outputs import EngineRequest
from engine.sampling import SamplingParams

T = TypeVar("T")

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class DecodeTiming:
    batch: int
    step_ms: float
    """Mean wall time of one decode step over the timed run."""
    mean_context: float
    """KV positions a request attends over in a timed step, on average."""


def llama3_8b_config() -> LlamaConfig:
    """Llama-3-8B's shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, SwiGLU
    14336, vocab 128256, rope theta 500000); EOS and padding are the demo tokenizer's."""
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        hidden_act="silu",
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=END_OF_TEXT_ID,
        dtype="bfloat16",
    )


def shapes_only_folder(config: LlamaConfig, tokenizer_dir: Path, out_dir: Path) -> Path:
    """A model folder with config.json and the demo tokenizer but no weights: the engine gives
    it seeded random ones (`EngineConfig.random_weights`). Ids past the tokenizer's vocabulary
    decode to nothing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def describe_model(folder: Path, name: str, dtype: str, device: str) -> dict[str, Any]:
    config = LlamaConfig.from_dict(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    return {
        "name": name,
        "dtype": dtype,
        "device": device,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "parameters": parameters,
    }


def time_decode(
    engine: LLMEngine,
    adapters: Sequence[str | None],
    prompt_len: int,
    warmup_steps: int,
    steps: int,
    rng: random.Random,
) -> DecodeTiming:
    """Decode steps with len(adapters) running requests, request i on adapters[i] (None: the
    base model). Needs max_model_len >= prompt_len + steps the prefill takes + warmup + steps."""
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    ids = [f"timed-{rng.getrandbits(48):x}-{i}" for i in range(len(adapters))]
    vocab = engine.model_config.vocab_size
    for request_id, adapter in zip(ids, adapters, strict=True):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(
            EngineRequest(request_id, params, prompt_token_ids=prompt, adapter=adapter)
        )
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(out.request_id for out in engine.step())
    for _ in range(warmup_steps):
        engine.step()
    contexts = [len(seq) for seq in engine.scheduler.running]
    device = engine.config.device
    begin = now(device)
    for _ in range(steps):
        engine.step()
    seconds = now(device) - begin
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
    mean_context = sum(contexts) / len(contexts) + (steps - 1) / 2
    return DecodeTiming(len(ids), seconds / steps * 1e3, mean_context)


def step_bytes(engine: LLMEngine, timing: DecodeTiming) -> int:
    """Bytes a decode step must read at least: every weight but the embedding table (only the
    batch's rows of it), and the KV of every position each request attends over."""
    model = engine.model
    element = torch.empty((), dtype=engine.config.torch_dtype).element_size()
    weights = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters(remove_duplicate=False)
        if name != "embed_tokens.weight"
    )
    embedding_rows = timing.batch * model.config.hidden_size * element
    per_token = kv_bytes_per_block(model.config, 1, engine.config.torch_dtype)
    return int(weights + embedding_rows + timing.batch * timing.mean_context * per_token)


def copy_bandwidth(nbytes: int, device: str, iters: int) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    begin = now(device)
    for _ in range(iters):
        dst.copy_(src)
    seconds = now(device) - begin
    del src, dst
    return 2 * nbytes * iters / seconds


def with_engine(config: EngineConfig, measure: Callable[[LLMEngine], T]) -> T:
    """`measure` on a fresh engine, whose memory is handed back before this returns (the next
    engine of a suite needs the room)."""
    engine = LLMEngine(config)
    try:
        return measure(engine)
    finally:
        if engine.lora is not None:
            engine.lora.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
