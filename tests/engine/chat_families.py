"""Small offline tokenizers for the chat-template families the engine loads.

Each has its family's real special tokens, tokenizer pipeline and official chat template text;
only the vocabulary is small (trained in well under a second on a few standard-library sources).
They are saved and reloaded with `AutoTokenizer`, as the engine loads a model folder.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers as tk_trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2-7B-Instruct's template.
QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.3's template (v3 tokenizer: [INST] and [/INST] are control tokens;
# the system message goes before the last user message; tool calls and results).
MISTRAL_V3_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# The pre-tokenizer regexes of the two byte-level families (Llama 3 groups digits by three).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
)
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MISTRAL_V3_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(encoding="utf-8") for f in sorted(stdlib.glob("*.py"))[:12]]
    chat = "system user assistant You are a helpful assistant. Hello, how are you today?\n\n"
    return [*texts, chat * 20]


def _byte_level(split: str, normalizer: Any, ignore_merges: bool) -> Tokenizer:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizer
    trained.pre_tokenizer = pre
    trained.train_from_iterator(
        _corpus(),
        tk_trainers.BpeTrainer(
            vocab_size=1200,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    spec = json.loads(trained.to_str())["model"]
    tok = Tokenizer(
        models.BPE(
            vocab=spec["vocab"],
            merges=[
                tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]
            ],
            ignore_merges=ignore_merges,
        )
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(legacy: bool) -> Tokenizer:
    """A SentencePiece-style BPE: `▁` for spaces, byte fallback, specials first, then the bytes.

    `legacy` is the Llama-2 style pipeline (a normalizer prefixes every piece between added tokens
    with `▁`); otherwise the Metaspace pre-tokenizer prefixes only the start of the input."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trained.train_from_iterator(
        _corpus(), tk_trainers.BpeTrainer(vocab_size=1200, show_progress=False)
    )
    spec = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(MISTRAL_V3_SPECIALS)}
    vocab |= {f"<0x{b:02X}>": len(MISTRAL_V3_SPECIALS) + b for b in range(256)}
    for token, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if legacy:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def _llama3() -> PreTrainedTokenizerFast:
    tok = _byte_level(_LLAMA3_SPLIT, None, ignore_merges=True)
    tok.add_special_tokens(list(LLAMA3_SPECIALS))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _qwen2() -> PreTrainedTokenizerFast:
    tok = _byte_level(_QWEN2_SPLIT, normalizers.NFC(), ignore_merges=False)
    tok.add_special_tokens(list(QWEN2_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=QWEN2_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _mistral_v3(legacy: bool) -> PreTrainedTokenizerFast:
    tok = _sentencepiece_bpe(legacy)
    tok.add_special_tokens(list(MISTRAL_V3_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=list(MISTRAL_V3_SPECIALS[3:]),
        chat_template=MISTRAL_V3_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


BUILDERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "llama3": _llama3,
    "qwen2": _qwen2,
    "mistral-v3": lambda: _mistral_v3(legacy=False),
    "mistral-v3-legacy": lambda: _mistral_v3(legacy=True),
}


def family_tokenizer(name: str, folder: Path) -> Any:
    """The tokenizer of family `name`, saved into `folder` and loaded back with AutoTokenizer."""
    BUILDERS[name]().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)
