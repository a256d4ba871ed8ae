"""The benchmarks' models: the realistic shape, seeded random weights in HF layout, and the
LoRA FLOPs share that says how big an adapter is against its model."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from bench import lora_batching
from bench.common import RunSettings, result_path
from bench.models import (
    build_random_llama,
    llama3_8b_config,
    lora_flops_per_token,
    model_flops_per_token,
    realistic_cpu_config,
)
from loramux.adapters.demo import DEMO_RANKS, demo_lora_config
from loramux.engine.demo_model import VOCAB_SIZE


def tiny_config() -> LlamaConfig:
    """Realistic in kind (GQA, head_dim not hidden / heads, untied lm_head), tiny in size."""
    config = realistic_cpu_config()
    config.update(
        {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "head_dim": 8}
    )
    config.update({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96})
    return config


def settings(model_size: str, mode: str = "quick") -> RunSettings:
    return RunSettings(mode, "cpu", "float32", model_size, None, Path("results"), 1, ())


def test_realistic_cpu_model_is_llama_shaped_with_the_demo_vocabulary() -> None:
    config = realistic_cpu_config()
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        1024,
        2816,
        4,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 64)
    assert config.vocab_size == VOCAB_SIZE and not config.tie_word_embeddings


def test_model_flops_count_every_linear_weight_twice() -> None:
    config = tiny_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_token(config) == 2 * linear


def test_lora_flops_count_every_lora_weight_twice() -> None:
    """x @ A and (x A) @ B: one multiply-add per LoRA weight, for every rank and target set."""
    config = tiny_config()
    for index in range(10):
        lora = demo_lora_config(index, (2, 4))
        model = get_peft_model(LlamaForCausalLM(config), lora)
        weights = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
        assert lora_flops_per_token(config, lora) == 2 * weights


def test_realistic_adapters_cost_a_few_percent_of_the_model() -> None:
    """The realistic ranks' median share is 0.5-3%; the demo's rank 64 on every projection
    would cost ~10% even of the wide model."""
    for config, ranks in (
        (realistic_cpu_config(), lora_batching.REALISTIC_RANKS),
        (llama3_8b_config(), lora_batching.CUDA_REALISTIC_RANKS),
    ):
        base = model_flops_per_token(config)
        shares = [
            lora_flops_per_token(config, demo_lora_config(i, ranks)) / base for i in range(20)
        ]
        assert min(shares) > 0.001 and max(shares) < 0.05
        assert 0.005 < statistics.median(shares) < 0.03
    wide = realistic_cpu_config()
    full_rank_64 = lora_flops_per_token(wide, demo_lora_config(15, DEMO_RANKS))  # rank 64, all
    assert full_rank_64 / model_flops_per_token(wide) > 0.05


def test_random_llama_is_seeded_hf_layout_of_its_config(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    folder = build_random_llama(tmp_path / "a", tiny_config(), demo_model_dir, "cpu", torch.float32)
    again = build_random_llama(tmp_path / "b", tiny_config(), demo_model_dir, "cpu", torch.float32)
    model = LlamaForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.float32
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (16, 64)
    assert model.lm_head.weight.shape == (96, 64)
    assert (folder / "tokenizer.json").is_file()
    same = LlamaForCausalLM.from_pretrained(again).state_dict()
    assert all(torch.equal(t, same[name]) for name, t in model.state_dict().items())


@pytest.mark.parametrize(
    ("model_size", "mode", "name"),
    [
        ("demo", "quick", "lora_batching-quick.json"),
        ("demo", "full", "lora_batching.json"),
        ("1b", "full", "lora_batching.json"),
        ("realistic", "quick", "lora_batching-realistic-quick.json"),
        ("realistic", "full", "lora_batching-realistic.json"),
    ],
)
def test_realistic_results_never_overwrite_demo_results(
    model_size: str, mode: str, name: str
) -> None:
    assert result_path("lora_batching", settings(model_size, mode)).name == name


def test_lora_batching_keeps_the_demo_workload_and_shrinks_ranks_when_realistic() -> None:
    demo = lora_batching.choose_workload(settings("demo"))
    realistic = lora_batching.choose_workload(settings("realistic"))
    assert demo == lora_batching.WORKLOADS["quick"] and demo.ranks == DEMO_RANKS
    assert realistic.ranks == lora_batching.REALISTIC_RANKS
    assert (realistic.speedup_goal, realistic.spread_goal) == (5.0, 0.9)
