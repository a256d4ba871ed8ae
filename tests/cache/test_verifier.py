"""The strict verifier accepts rewordings that keep every meaning-bearing word, and names the
check that refuses a close but different question."""

from __future__ import annotations

import pytest

from cache.verifier import parse, stem, verify

SAME = [
    ("How do I reset my password?", "How can I reset my password"),
    ("What is the capital of France?", "what's the capital of france"),
    ("What is 15% of 200?", "What is 15 percent of 200?"),
    ("Why won't my laptop turn on?", "Why doesn't my laptop turn on?"),
    ("Is the museum open on Mondays?", "Is the museum open on Monday?"),
    ("Give me three tips for better sleep.", "Please give me 3 tips for better sleep"),
    ("How much does shipping cost for 1,000 units?", "How much does shipping cost for 1000 units?"),
]

DIFFERENT = [
    ("Convert 5 kilometers to miles.", "Convert 50 kilometers to miles.", "number"),
    ("Give me three tips for better sleep.", "Give me five tips for better sleep.", "number"),
    ("Which foods contain gluten?", "Which foods don't contain gluten?", "negation"),
    ("Show me recipes with cheese.", "Show me recipes without cheese.", "negation"),
    ("What is the population of Tokyo?", "What is the population of Osaka?", "entity"),
    ("How do I take a screenshot on Windows?", "How do I take a screenshot on a Mac?", "entity"),
    ("How do I increase the font size?", "How do I decrease the font size?", "antonym"),
    ("How do I install Docker?", "How do I uninstall Docker?", "antonym"),
    ("How do I zoom in on the map?", "How do I zoom out on the map?", "antonym"),
    ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles.", "order"),
    ("How do I redirect http to https?", "How do I redirect https to http?", "order"),
    ("What is 2 to the power of 3?", "What is 3 to the power of 2?", "order"),
    ("How long does shipping take?", "How long does international shipping take?", "wording"),
    ("How do I make pancakes?", "How do I make waffles?", "wording"),
]


@pytest.mark.parametrize(("a", "b"), SAME)
def test_rewordings_are_accepted_both_ways(a: str, b: str) -> None:
    assert verify(a, b).accepted and verify(b, a).accepted


@pytest.mark.parametrize(("a", "b", "reason"), DIFFERENT)
def test_close_but_different_questions_are_refused_with_the_reason(
    a: str, b: str, reason: str
) -> None:
    assert verify(a, b).reason == reason
    assert verify(b, a).reason == reason
    assert not verify(a, b).accepted


def test_identical_questions_are_accepted() -> None:
    assert verify("Who wrote Hamlet?", "Who wrote Hamlet?").reason == "ok"


def test_stemming_equates_inflections_only() -> None:
    assert {stem(w) for w in ("close", "closes", "closed", "closing")} == {"clos"}
    assert stem("class") == "class"


def test_parse_reads_numbers_negations_and_entities() -> None:
    q = parse("Isn't it true that Alice paid $1,000 for two tickets in Paris?")
    assert q.numbers == (2.0, 1000.0)
    assert q.negations == 1
    assert q.entities == frozenset({"alice", "paris"})
