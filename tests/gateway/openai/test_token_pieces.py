"""A token's text and bytes as logprobs report them: the bytes of a text's tokens join to the
text's UTF-8 whatever splits a character (byte-level BPE), and a byte-fallback token is its one
raw byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from loramux.engine.demo_model import IM_END_ID
from loramux.engine.outputs import TokenLogprob
from loramux.gateway.openai.logprobs import TokenPieces

TEXTS = [
    "plain words",
    "naïve café",
    "日本語のテキスト",
    "emoji 🦀🚀 and \u200b zero width",
    "tab\tnew\nline",
]


@pytest.fixture(scope="module")
def demo_pieces(demo_model_dir: Path) -> tuple[TokenPieces, object]:
    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_dir))
    return TokenPieces(tokenizer), tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_the_bytes_of_a_texts_tokens_join_to_its_utf8(
    demo_pieces: tuple[TokenPieces, object], text: str
) -> None:
    pieces, tokenizer = demo_pieces
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    joined = b"".join(bytes(pieces.piece(i)[1]) for i in ids)
    assert joined == text.encode()


def test_a_token_that_splits_a_character_reads_as_the_replacement_character(
    demo_pieces: tuple[TokenPieces, object],
) -> None:
    pieces, tokenizer = demo_pieces
    ids = tokenizer.encode("🦀", add_special_tokens=False)  # type: ignore[attr-defined]
    partial = [pieces.piece(i) for i in ids if len(pieces.piece(i)[1]) < 4]
    if not partial:
        pytest.skip("the demo vocabulary holds the character whole")
    assert all("\ufffd" in text for text, _ in partial)


def test_a_byte_fallback_token_is_its_raw_byte() -> None:
    vocab = {"<unk>": 0, "a": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    bpe = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe), unk_token="<unk>")
    pieces = TokenPieces(tokenizer)
    assert pieces.piece(2 + 0xE2) == ("\ufffd", [0xE2])
    assert pieces.piece(1) == ("a", [ord("a")])


def test_chat_entries_carry_the_top_alternatives_in_order(
    demo_pieces: tuple[TokenPieces, object],
) -> None:
    pieces, _ = demo_pieces
    [entry] = pieces.chat_entries([5], [TokenLogprob(-0.5, [(5, -0.5), (6, -1.5)])])
    assert (entry.token, entry.logprob, entry.bytes) == (
        *pieces.piece(5)[:1],
        -0.5,
        pieces.piece(5)[1],
    )
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
        (pieces.piece(5)[0], -0.5),
        (pieces.piece(6)[0], -1.5),
    ]


def test_chat_entries_leave_out_the_tokens_the_content_does_not_show(
    demo_pieces: tuple[TokenPieces, object],
) -> None:
    """The detokenizer skips special tokens, so chat entries do too: the bytes of the entries
    of a turn that ended at <|im_end|> join to its text. Legacy logprobs keep every token."""
    pieces, tokenizer = demo_pieces
    ids = [*tokenizer.encode("calm sea", add_special_tokens=False), IM_END_ID]  # type: ignore[attr-defined]
    logprobs = [TokenLogprob(-0.5, [(t, -0.5), (IM_END_ID, -1.0)]) for t in ids]
    entries = pieces.chat_entries(ids, logprobs)
    assert b"".join(bytes(e.bytes or []) for e in entries) == b"calm sea"
    assert entries[-1].top_logprobs[1].token == "<|im_end|>"  # an alternative, not content
    legacy = pieces.text_logprobs(ids, logprobs, list(range(len(ids))))
    assert legacy.tokens[-1] == "<|im_end|>"


def test_legacy_top_logprobs_keep_the_likelier_of_two_tokens_named_alike() -> None:
    """A token whose text is `bytes:\\xe2` reads like the byte-fallback token of 0xE2: their
    one legacy key holds the likelier's logprob, and the sampled token's never replaces
    another token's."""
    vocab = {"<unk>": 0, "bytes:\\xe2": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    bpe = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe), unk_token="<unk>")
    pieces = TokenPieces(tokenizer)
    assert pieces.name(2 + 0xE2) == pieces.name(1) == "bytes:\\xe2"
    out = pieces.text_logprobs([1], [TokenLogprob(-2.0, [(2 + 0xE2, -0.5), (1, -2.0)])], [0])
    assert out.tokens == ["bytes:\\xe2"] and out.top_logprobs == [{"bytes:\\xe2": -0.5}]
