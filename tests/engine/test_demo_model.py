"""The demo model: a small seeded Llama checkpoint that loads offline with transformers."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput

from loramux.engine.demo_model import build_demo_model

CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _sha256_by_name(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def model(demo_model_dir: Path) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):  # the class transformers picks is its own business
    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_folder_holds_a_safetensors_checkpoint_and_tokenizer(demo_model_dir: Path) -> None:
    names = {f.name for f in demo_model_dir.iterdir()}
    assert names >= CHECKPOINT_FILES
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)


def test_architecture_and_sizes(model: LlamaForCausalLM) -> None:
    config = model.config
    assert isinstance(model, LlamaForCausalLM)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (256, 704, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 32)
    assert config.vocab_size == 4096
    assert config.max_position_embeddings == 2048
    assert config.rope_parameters is not None
    assert config.rope_parameters["rope_theta"] == 10000.0
    assert config.rms_norm_eps == 1e-5
    assert config.hidden_act == "silu"
    assert not config.tie_word_embeddings
    assert model.dtype == torch.float32
    weights = model.state_dict()
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert embed.shape == head.shape == (4096, 256)
    assert embed.data_ptr() != head.data_ptr()
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (8 * 32, 256)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 256)
    assert weights["model.layers.3.mlp.gate_proj.weight"].shape == (704, 256)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (256, 704)


def test_stop_and_pad_tokens_are_consistent(model: LlamaForCausalLM, tokenizer) -> None:
    end_of_text, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert model.generation_config.eos_token_id == [im_end, end_of_text]
    assert model.config.eos_token_id == [im_end, end_of_text]
    assert model.config.pad_token_id == model.generation_config.pad_token_id == end_of_text
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == end_of_text
    assert tokenizer.bos_token is None


def test_tokenizer_is_byte_level_bpe_of_the_full_vocabulary(tokenizer) -> None:
    assert len(tokenizer) == 4096
    vocab = tokenizer.get_vocab()
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(vocab)
    assert "Ġdef" in vocab  # a merge learnt from Python sources


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n\treturn x  # done",
        "naïve café — 日本語",
        "emoji 🙂, NUL \x00 and control \x7f",
        "  leading and trailing spaces  ",
    ],
)
def test_tokenizer_round_trips_any_text_exactly(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_in_text_are_single_tokens(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_chat_template_is_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == rendered.removesuffix("<|im_start|>assistant\n")


def test_generate_runs_greedily_from_a_chat_prompt(model: LlamaForCausalLM, tokenizer) -> None:
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    first = _greedy(model, input_ids, max_new_tokens=16).sequences
    second = _greedy(model, input_ids, max_new_tokens=16).sequences
    assert first.shape[1] > input_ids.shape[1]
    assert torch.equal(first[:, : input_ids.shape[1]], input_ids)
    assert torch.equal(first, second)


def _greedy(
    model: LlamaForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any
) -> GenerateDecoderOnlyOutput:
    """`model.generate` without sampling, returning sequences and per-step scores."""
    with torch.no_grad():
        out = model.generate(  # type: ignore[misc]  # mypy rejects transformers' self-type Protocol
            input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    assert isinstance(out, GenerateDecoderOnlyOutput)
    return out


def _top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def test_greedy_choice_is_far_above_float32_noise(
    demo_model_dir: Path, model: LlamaForCausalLM, tokenizer
) -> None:
    """Engines sum in other orders than transformers; greedy tokens must not depend on it.

    Over greedy continuations and teacher-forced random tokens, the gap between the two best
    logits stays orders of magnitude above the float32 error (measured against float64).
    """
    reference = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float64).eval()
    forced = torch.randint(4096, (1, 256), generator=torch.Generator().manual_seed(0))
    gaps = []
    with torch.no_grad():
        logits32, logits64 = model(forced).logits[0], reference(forced).logits[0]
        gaps.append(_top2_gaps(logits32))
        for prompt in ["def main(argv):", "The quick brown fox", "naïve café — 日本語"]:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            scores = _greedy(model, ids, max_new_tokens=64, eos_token_id=None).scores
            assert scores is not None
            gaps.append(_top2_gaps(torch.cat(scores)))
    gap = torch.cat(gaps)
    float32_error = (logits32.double() - logits64).abs().max().item()
    assert torch.equal(logits32.argmax(-1), logits64.argmax(-1))
    assert gap.median() > 0.1
    assert gap.quantile(0.01) > 100 * float32_error


def test_same_seed_builds_byte_identical_folders(demo_model_dir: Path, tmp_path: Path) -> None:
    again = build_demo_model(tmp_path / "nested" / "again", seed=0)
    assert again == tmp_path / "nested" / "again"
    assert _sha256_by_name(again) == _sha256_by_name(demo_model_dir)


def test_another_seed_changes_only_the_weights(demo_model_dir: Path, tmp_path: Path) -> None:
    other = build_demo_model(tmp_path, seed=1)
    ours, theirs = _sha256_by_name(demo_model_dir), _sha256_by_name(other)
    assert {name for name in ours if ours[name] != theirs[name]} == {"model.safetensors"}
    weights0 = load_file(demo_model_dir / "model.safetensors")
    weights1 = load_file(other / "model.safetensors")
    assert weights0.keys() == weights1.keys()
    for name in weights0:
        if name.endswith("norm.weight"):
            continue  # RMSNorm gains are ones whatever the seed
        assert not torch.equal(weights0[name], weights1[name]), name
