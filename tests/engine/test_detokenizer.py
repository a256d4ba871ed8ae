"""Incremental detokenization never emits half a character or a partial stop string."""

from __future__ import annotations

from typing import Any

from loramux.engine.detokenizer import IncrementalDetokenizer


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
