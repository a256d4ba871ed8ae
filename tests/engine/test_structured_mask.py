"""The grammar's token mask: the device op equals its definition bit for bit, rows without a
grammar are left alone, and a structured output crosses the engine channel unchanged."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from loramux.engine.chat_prompt import control_tokens
from loramux.engine.sampling import SamplingParams
from loramux.engine.service.wire import Generate, decode_to_engine, encode, error_from, failure
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.engine.structured.grammar import GrammarCompiler, GrammarMatcher
from loramux.engine.structured.mask import GrammarBitmask, apply_token_mask_
from loramux.engine.structured.schema import json_depth
from tests.engine.chat_families import BUILDERS, family_tokenizer


def _reference(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows.tolist()):
        for v in range(logits.shape[1]):
            if not (int(words[i, v // 32]) >> (v % 32)) & 1:
                out[row, v] = float("-inf")
    return out


@pytest.mark.parametrize(
    ("vocab", "num_rows", "rows"), [(64, 3, [1]), (100, 4, [3, 0, 2]), (37, 2, [0, 1])]
)
def test_the_mask_op_equals_its_definition(vocab: int, num_rows: int, rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=generator)
    words = torch.randint(
        -(2**31), 2**31, (len(rows), -(-vocab // 32)), dtype=torch.int64, generator=generator
    ).to(torch.int32)
    words[0, 0] = -1  # every bit of a word, the sign bit included
    index = torch.tensor(rows, dtype=torch.int64)
    expected = _reference(logits, words, index)
    apply_token_mask_(logits, words, index)
    assert torch.equal(logits, expected)


def test_a_step_without_grammars_fills_nothing(demo_model_dir: object) -> None:
    masks = GrammarBitmask(max_rows=4, vocab_size=4096, device=torch.device("cpu"))
    assert masks.fill([]) is None


def test_compiled_grammars_are_cached_by_schema_text(demo_model_dir: object) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    compiler = GrammarCompiler(tokenizer, 4096, [0, 2])
    spec = StructuredOutput("json_schema", '{"type": "object"}')
    assert compiler.compile(spec) is compiler.compile(
        StructuredOutput("json_schema", spec.json_schema or "")
    )
    first, second = compiler.compile(spec).matcher(), compiler.compile(spec).matcher()
    assert first.accept(tokenizer.encode("{")[0]) and second.ll.is_accepting() is False
    assert not first.accept(tokenizer.encode("x")[0]), "a token the grammar forbids fails it"
    assert first.error


def _allowed(matcher: GrammarMatcher, vocab_size: int) -> list[int]:
    words = torch.frombuffer(bytearray(matcher.ll.compute_bitmask()), dtype=torch.int32)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab_size]


@pytest.mark.parametrize("family", ["demo", *BUILDERS])
def test_a_literal_holding_control_token_text_is_generated_as_text(
    family: str, tokenizer: Any, tmp_path: Path
) -> None:
    """A `const` (or a property name) that holds a control token's text forces that text, and
    the grammar allows it only as plain text: no control token is ever allowed before the value
    is complete, and any walk through the masks spells the literal. The bug: the grammar
    library tokenized forced text with the model's tokenizer, which parses control-token text
    into the control token, so it allowed that token, then failed the request on it (500)."""
    tok = tokenizer if family == "demo" else family_tokenizer(family, tmp_path)
    control = control_tokens(tok)
    eos = [tok.eos_token_id]
    compiler = GrammarCompiler(tok, len(tok), eos)
    rng = random.Random(3)
    for text in control:
        for value in ({"const": f"a{text}b"}, {"const": text}, {"enum": [text, "x"]}):
            schema = {"type": "object", "properties": {text: value}, "required": [text]}
            schema["additionalProperties"] = False
            matcher = compiler.compile(
                StructuredOutput("json_schema", json.dumps(schema))
            ).matcher()
            ids: list[int] = []
            while (allowed := _allowed(matcher, len(tok))) != eos:
                assert not set(allowed) & set(control.values()), (text, allowed)
                ids.append(rng.choice(allowed))
                assert matcher.accept(ids[-1]), matcher.error
            assert json.loads(tok.decode(ids))[text] in (f"a{text}b", text, "x")


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth('{"a": [1, {"b": "[[[{{{"}]}') == 3
    assert json_depth('"\\"[" ') == 0
    assert json_depth("[" * 5000) == 5000


def test_a_structured_output_round_trips_the_engine_channel() -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}})
    for structured in (
        StructuredOutput("json_schema", schema),
        StructuredOutput("json_object"),
        None,
    ):
        params = SamplingParams(max_tokens=7, structured=structured)
        message = Generate("token", "r1", [1, 2], params)
        decoded = decode_to_engine(encode(message))
        assert isinstance(decoded, Generate) and decoded.params == params


def test_a_structured_output_error_keeps_its_class_across_the_channel() -> None:
    sent = failure("r1", False, StructuredOutputError("the JSON schema is not valid JSON"))
    assert sent is not None and sent.code == "invalid_structured_output"
    received = error_from(sent)
    assert type(received) is StructuredOutputError and "not valid JSON" in str(received)
