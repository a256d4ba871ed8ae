"""Incremental detokenization never emits half a character or a partial stop string."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE
from transformers import AutoTokenizer

from loramux.engine.detokenizer import (
    MAX_HELD_TOKENS,
    IncrementalDetokenizer,
    RustDecoder,
    rust_decoder,
)
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


class _Rescanning(IncrementalDetokenizer):
    """The stop matching as it was before StopMatcher, as the reference: each token, search the
    text not yet handed out for every stop string, and hold back the longest suffix of the text
    that begins one (every prefix tried, longest first). Quadratic in a stop string's length.
    (It then cut at each match in `stop`'s order, so of two stop strings that one token
    completes the earlier listed could win; both now cut where the first of them starts.)"""

    def _stable_end(self, read: int) -> int:
        found = [self.text.find(s, max(0, self.emitted - len(s) + 1)) for s in self.stop]
        if starts := [at for at in found if at != -1]:
            self.stopped, self.text = True, self.text[: min(starts)]
        end = len(self.text)
        for s in () if self.stopped else self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    end = min(end, len(self.text) - k)
                    break
        return end


def test_stop_matching_equals_rescanning_the_text(tokenizer: Any) -> None:
    """Random text over a small alphabet (so stop strings begin and match often, across token
    boundaries and several at once): the same deltas, held back and cut at the same places."""
    rng = random.Random(11)
    alphabet = "ab a\nba"
    stopped = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        stops = tuple(
            text[i : i + rng.randint(1, 8)]
            if rng.random() < 0.5
            else "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
            for i in (rng.randrange(len(text)) for _ in range(rng.randint(1, 4)))
        )
        ids = tokenizer.encode(text)
        mine = IncrementalDetokenizer(tokenizer, stop=stops)
        reference = _Rescanning(tokenizer, stop=stops)
        deltas = [(mine.add(t), reference.add(t)) for t in ids]
        assert [d[0] for d in deltas] == [d[1] for d in deltas], (text, stops)
        assert (mine.flush(), mine.stopped, mine.text) == (
            reference.flush(),
            reference.stopped,
            reference.text,
        )
        stopped += mine.stopped
    assert 100 < stopped < 300  # both outcomes, often


def test_a_long_stop_string_is_matched_across_many_tokens(tokenizer: Any) -> None:
    long_stop = "the end " * 500
    deltas, detok = _stream(tokenizer, "x " + long_stop + "after", stop=(long_stop,))
    assert "".join(deltas) == "x " and detok.stopped
    deltas, detok = _stream(tokenizer, "x " + long_stop[:-1], stop=(long_stop,))
    assert "".join(deltas[:-1]) == "x " and deltas[-1] == long_stop[:-1]  # held back to the end
    assert "".join(deltas) == "x " + long_stop[:-1] and not detok.stopped


def test_of_stop_strings_one_token_completes_the_text_ends_before_the_first_to_start(
    tokenizer: Any,
) -> None:
    for stop in (("a", "\na"), ("\na", "a")):  # whatever their order
        deltas, detok = _stream(tokenizer, "x \nab", stop=stop)
        assert "".join(deltas) == "x " and detok.stopped


def test_the_choices_of_a_request_share_each_stop_strings_table(tokenizer: Any) -> None:
    """A stop string's matching table is built once, however many choices match it (it was
    built per choice on the event loop: 16 choices of four long stops took seconds), while each
    choice keeps its own position in it."""
    stops = ("ab" * 400 + "c", "xyz")
    choices = [IncrementalDetokenizer(rust_decoder(tokenizer), stop=stops) for _ in range(16)]
    for i in range(len(stops)):
        assert len({id(d.matchers[i].fail) for d in choices}) == 1
    first, second = choices[0], choices[1]
    first.matchers[1].read("xy", 0)
    assert (first.matchers[1].matched, second.matchers[1].matched) == (2, 0)


class _Counting:
    """A decoder that counts the tokens it is asked to decode."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.decoded = 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded += len(token_ids)
        return str(self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens))


def _lead_byte(tokenizer: Any) -> int:
    """The demo tokenizer's token for the lone byte 0xE2, which begins a 3-byte character (its
    byte-level alphabet writes that byte as "â")."""
    token = tokenizer.convert_tokens_to_ids("â")
    assert tokenizer.decode([token]) == "\ufffd"
    return int(token)


def test_bytes_that_never_complete_a_character_cost_linear_work_and_show_as_replacements(
    tokenizer: Any,
) -> None:
    """2,000 lone lead bytes (a tenant can force them with logit_bias) are detokenized with a
    few tokens decoded per token, and the text is the whole output's decode, one U+FFFD a byte,
    at the end. The bug: each token decoded the whole held run twice (about 4,000,000 tokens
    decoded here), and the run's text was dropped while its tokens were billed."""
    counting = _Counting(rust_decoder(tokenizer))
    detok = IncrementalDetokenizer(counting)
    ids = [_lead_byte(tokenizer)] * 2000
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert counting.decoded <= 10 * len(ids)
    assert "".join(deltas) == tokenizer.decode(ids) == "\ufffd" * len(ids)


def test_random_runs_of_high_bytes_decode_as_the_whole_output_does(tokenizer: Any) -> None:
    """Tokens drawn mostly from the single bytes 0x80-0xFF (lead bytes, continuation bytes, in
    any order) among others: however characters complete or never do, the deltas join to
    transformers' decode of the whole output."""
    special = set(tokenizer.added_tokens_decoder)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    high = [i for i in vocab if all(ord(c) >= 0x80 for c in tokenizer.convert_ids_to_tokens(i))]
    rng = random.Random(5)
    for _ in range(500):
        ids = [rng.choice(high if rng.random() < 0.7 else vocab) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(rust_decoder(tokenizer))
        deltas = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids), ids


def test_flush_releases_the_bytes_held_back_as_replacement_characters(tokenizer: Any) -> None:
    """An output that ends inside a character ends with its held bytes shown as U+FFFD, as the
    whole output's decode shows them. The bug: flush released only the text already decoded,
    so an output of lone lead bytes answered "" while its tokens were billed."""
    lead = _lead_byte(tokenizer)
    for ids in ([lead], [lead] * 3, [*tokenizer.encode("ab"), lead]):
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids), ids


def _straddling_tokenizer() -> tuple[RustDecoder, list[int], str]:
    """A byte-level tokenizer whose tokens straddle characters: "你" (E4 BD A0) then "好" (E5 A5
    BD) repeated, cut one byte in and then every 3 bytes, so no token boundary but the last
    ends a character (merges across characters do this in byte-level vocabularies)."""
    alphabet = _bytes_to_unicode()
    text = "你好" * 10
    data = text.encode()
    pieces = [data[:1]] + [data[i : i + 3] for i in range(1, len(data), 3)]
    vocab = {
        "".join(alphabet[b] for b in piece): i for i, piece in enumerate(dict.fromkeys(pieces))
    }
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.decoder = ByteLevelDecoder()
    ids = [vocab["".join(alphabet[b] for b in piece)] for piece in pieces]
    return RustDecoder(backend), ids, text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character its vocabularies write it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(extra)}


def test_valid_text_in_tokens_that_straddle_characters_decodes_exactly() -> None:
    """20 tokens, none but the last ending a character: the text comes whole when the last
    one completes it, with a few tokens decoded per token meanwhile. Cutting such a run after
    4, then 16, held tokens showed U+FFFD in valid text, and then dropped a character (found
    by attacking the fixes)."""
    decoder, ids, text = _straddling_tokenizer()
    assert decoder.decode(ids) == text and len(ids) > 4 * MAX_HELD_TOKENS
    counting = _Counting(decoder)
    detok = IncrementalDetokenizer(counting)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert counting.decoded <= 10 * len(ids) + 2 * len(ids)  # the run's decode, once complete


def test_skipped_special_tokens_after_an_incomplete_character_cost_linear_work(
    tokenizer: Any,
) -> None:
    """A lone lead byte, then 2,000 special tokens that decoding skips (a tenant can force them
    with logit_bias): they add no text, so the held window is not decoded again for each. It
    was, since their tail decoded to nothing rather than to U+FFFD: 2,012,990 tokens decoded."""
    special = next(
        i
        for i, token in sorted(tokenizer.added_tokens_decoder.items())
        if token.special and i != tokenizer.eos_token_id
    )
    counting = _Counting(rust_decoder(tokenizer))
    detok = IncrementalDetokenizer(counting)
    ids = [_lead_byte(tokenizer)] + [special] * 2000
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded <= 10 * len(ids)
