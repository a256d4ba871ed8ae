"""Incremental detokenization never emits half a character or a partial stop string."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from loramux.engine.detokenizer import IncrementalDetokenizer, RustDecoder, rust_decoder
from tests.engine.chat_families import BUILDERS, family_tokenizer


def _stream(
    tokenizer: Any, text: str, stop: tuple[str, ...] = ()
) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    deltas = [detok.add(t) for t in tokenizer.encode(text)]
    deltas.append(detok.flush())
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    text = "naïve café — 日本語のテキスト 🙂 done"
    deltas, _ = _stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_partial_stop_string_is_held_back_then_released(tokenizer: Any) -> None:
    deltas, detok = _stream(tokenizer, "result = value END here", stop=("ENDING",))
    assert "".join(deltas) == "result = value END here"
    assert not detok.stopped


def test_stop_string_truncates(tokenizer: Any) -> None:
    deltas, detok = _stream(tokenizer, "alpha beta STOP gamma", stop=("STOP",))
    assert "".join(deltas) == "alpha beta "
    assert detok.stopped


@pytest.mark.parametrize("family", ["demo", *BUILDERS])
def test_the_rust_decoder_decodes_as_the_tokenizer_does(
    family: str, tokenizer: Any, tmp_path: Path
) -> None:
    """The gateway detokenizes with the Rust tokenizer directly where transformers would add
    nothing to it: the same text for any ids (special tokens, cut UTF-8, byte fallbacks), and
    the same deltas through the incremental detokenizer."""
    tok = tokenizer if family == "demo" else family_tokenizer(family, tmp_path)
    decoder = rust_decoder(tok)
    assert isinstance(decoder, RustDecoder)
    rng = random.Random(7)
    vocab = len(tok)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )
    text = "naïve café — 日本語 🙂 <|im_end|> x = [1, 2] ; end"
    ids = tok.encode(text)
    mine, theirs = IncrementalDetokenizer(decoder), IncrementalDetokenizer(tok)
    assert [mine.add(t) for t in ids] == [theirs.add(t) for t in ids]


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(
    tokenizer: Any, tmp_path: Path
) -> None:
    tokenizer.save_pretrained(tmp_path)
    cleaning = AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    assert rust_decoder(cleaning) is cleaning
