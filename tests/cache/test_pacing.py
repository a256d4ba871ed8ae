"""A streamed cache hit goes out at once, or paced one piece per completion token."""

from __future__ import annotations

import pytest

from loramux.cache.pacing import Pacing, hit_pieces, paced_hit

TEXT = "Paris is the capital of France."


def test_an_instant_hit_is_one_piece_with_no_delay() -> None:
    assert list(hit_pieces(TEXT, 7, Pacing("instant"))) == [(TEXT, 0.0)]


def test_a_paced_hit_is_one_piece_per_token_at_the_tenants_rate() -> None:
    pieces = list(hit_pieces(TEXT, 7, Pacing("paced", tokens_per_second=20.0)))
    assert "".join(p for p, _ in pieces) == TEXT
    assert len(pieces) == 7
    assert [d for _, d in pieces] == [0.0] + [0.05] * 6


@pytest.mark.parametrize(("text", "tokens"), [("", 5), ("x", 9), ("ab", 1_000_000), ("é🙂ü", 3)])
def test_pieces_always_concatenate_to_the_text(text: str, tokens: int) -> None:
    pieces = list(hit_pieces(text, tokens, Pacing("paced", tokens_per_second=10_000)))
    assert "".join(p for p, _ in pieces) == text
    assert len(pieces) <= max(1, len(text))


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan"), float("inf"), 1e300])
def test_a_rate_out_of_range_is_refused(rate: float) -> None:
    with pytest.raises(ValueError):
        Pacing("paced", tokens_per_second=rate)


async def test_paced_hit_yields_the_pieces_in_order() -> None:
    pieces = [p async for p in paced_hit(TEXT, 4, Pacing("paced", tokens_per_second=10_000))]
    assert "".join(pieces) == TEXT and len(pieces) == 4
