"""The demo model: a small, seeded, offline-built Llama checkpoint in Hugging Face layout.

It is what tests, benchmarks and a zero-configuration `loramux serve` run on. It is built
from nothing but the seed and files already on the machine (Python's own standard-library
sources train the tokenizer), in about a second on a laptop CPU.

Invariants:
- Same seed, same interpreter and library versions → byte-identical files. Nothing in the
  build reads the clock, the environment or an unordered listing.
- The weights are random, but scaled so that greedy decoding is numerically robust: the gap
  between the two largest logits is typically far above float32 summation-order noise
  (~1e-5), so any correct implementation picks the same greedy tokens as `transformers`.
- Generation stops on `<|im_end|>` (end of a chat turn) or `<|endoftext|>` (end of text,
  also the padding token).
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The trainer gives special tokens the first ids, in this order.
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
END_OF_TEXT_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# A chat turn ends with <|im_end|>, a text with <|endoftext|>; either stops generation.
EOS_TOKEN_IDS = (IM_END_ID, END_OF_TEXT_ID)

HIDDEN_SIZE = 256
VOCAB_SIZE = 4096
TOKENIZER_TRAINING_FILES = 120

# Standard deviation of the logits over the vocabulary. The final RMSNorm makes the hidden
# state's root mean square ~1, so lm_head entries get std LOGIT_STD / sqrt(hidden_size).
# Measured on seeds 0-2 over 448 positions: top-2 logit gap median ~0.77, 1st percentile
# >= 0.01, while float32 logits differ from float64 by ~1.2e-5. Both scale with LOGIT_STD;
# 4 keeps logits at a familiar size (max ~22) and sampling non-degenerate.
LOGIT_STD = 4.0

CHATML_TEMPLATE = (
    # With tools, a system turn lists them (the first system message leads it) and teaches the
    # Hermes format: each call a JSON object inside <tool_call></tool_call>, the format Qwen2.5
    # uses. An assistant turn's calls are written back that way; a tool result is a turn of its
    # own (role `tool`). Without tools and tool turns the prompt is plain ChatML.
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within "
    "<tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, write a JSON object with the function name and "
    "arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{% for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls is defined "
    "and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + "
    "', \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>\\n' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_demo_model(out_dir: Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into `out_dir` (created if missing) and return `out_dir`.

    The folder loads offline with `AutoModelForCausalLM` and `AutoTokenizer`: config.json,
    generation_config.json, model.safetensors (float32) and the tokenizer files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    config.save_pretrained(out_dir)
    generation = GenerationConfig(eos_token_id=list(EOS_TOKEN_IDS), pad_token_id=END_OF_TEXT_ID)
    generation.save_pretrained(out_dir)
    save_file(
        _random_weights(config, seed), out_dir / "model.safetensors", metadata={"format": "pt"}
    )
    _train_tokenizer().save_pretrained(out_dir)
    return out_dir


def demo_config() -> LlamaConfig:
    """The demo architecture: 4 layers, hidden 256, SwiGLU 704, 8 query / 2 KV heads of 32."""
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=list(EOS_TOKEN_IDS),
        pad_token_id=END_OF_TEXT_ID,
        dtype="float32",
    )


def _random_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every parameter of `LlamaForCausalLM(config)`.

    Names and shapes come from the model built on the meta device, so they are exactly what
    `transformers` loads. Tensors are drawn in sorted-name order from one generator.
    Scales: embeddings N(0, 1) (the residual stream starts at RMS ~1); every projection
    N(0, 1/fan_in) so each sublayer's output is O(1); RMSNorm weights 1; lm_head as LOGIT_STD says.
    """
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.float32)
            continue
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(config.hidden_size)
        else:
            std = 1.0 / math.sqrt(shape[1])
        weights[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return weights


def _train_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (vocab 4096, byte alphabet included) trained on stdlib sources.

    Byte-level means every string round-trips exactly, whatever its script. Training is
    deterministic: the file list is sorted and the trainer breaks count ties by pair order.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:TOKENIZER_TRAINING_FILES]
    texts = [f.read_text(encoding="utf-8") for f in files]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    assert [bpe.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
