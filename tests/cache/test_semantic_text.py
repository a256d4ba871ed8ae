"""The semantic cache's text rules: quoted text, factorials and letter case.

A stored question and a close one whose answer differs must miss (a wrong hit is served
otherwise); plain paraphrases must still hit. Real embedder, verifier and Redis."""

from __future__ import annotations

import pytest

from loramux.cache.embedder import Embedder
from loramux.cache.keys import exact_only, question_text
from loramux.cache.verifier import verify
from tests.cache.conftest import SEMANTIC, MakeCache, answer, chat


async def _served(cache_maker: MakeCache, stored: str, asked: str) -> str | None:
    """Store an answer under `stored`, ask `asked`: the answer served, if any."""
    cache = cache_maker()
    await cache.store(chat(stored), SEMANTIC, answer("the answer to " + stored))
    hit = await cache.lookup(chat(asked), SEMANTIC)
    return None if hit is None else hit.response.text


QUOTED = [
    # A newline inside single quotes is not a space: the span is found on the raw message.
    ("Does 'foo bar' contain a space?", "Does 'foo\nbar' contain a space?"),
    ("Does ‘foo bar’ contain a space?", "Does ‘foo\nbar’ contain a space?"),
    # An apostrophe between letters does not close the span.
    ("How many spaces are in ‘don’t stop’?", "How many spaces are in ‘don’t  stop’?"),
    ("Reverse the string ‘It’s OK’", "Reverse the string ‘It’s ok’"),
    ("How many spaces are in 'don't stop'?", "How many spaces are in 'don't  stop'?"),
    # A quote left open: what it quotes cannot be told, so exact only.
    ('How many characters are in "Hello  World?', 'How many characters are in "hello world?'),
]


@pytest.mark.parametrize(("stored", "asked"), QUOTED)
async def test_quoted_text_differing_in_whitespace_or_case_misses(
    make_cache: MakeCache, stored: str, asked: str
) -> None:
    """Bug: a newline inside single quotes, or a span cut short at an apostrophe, left quoted
    text to be normalized (whitespace collapsed, case ignored): another string hit."""
    assert await _served(make_cache, stored, asked) is None


FACTORIALS = [
    ("What is 5!", "What is 5!!"),  # double factorial: 15, not 120
    ("What is 5! + 3", "What is 5 + 3!"),  # 123, not 11
    ("What is 3!*2", "What is 3*2!"),  # 12, not 6
    ("What is 2+3", "What is (2+3)!"),
]


@pytest.mark.parametrize(("stored", "asked"), FACTORIALS)
async def test_a_factorial_of_another_number_or_kind_misses(
    make_cache: MakeCache, stored: str, asked: str
) -> None:
    """Bug: "5!!" read as "5!", and numbers and operators compared as multisets, so a factorial
    moved to another number hit."""
    assert await _served(make_cache, stored, asked) is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("What is 5!", "What is the factorial of 5?"),
        ("What is 5! + 3", "What is 5! plus 3"),
        ("What is 5 factorial", "What is 5!"),
    ],
)
def test_a_factorial_reworded_is_accepted(a: str, b: str) -> None:
    """One number and one factorial: "5!" and "the factorial of 5" can only mean one thing."""
    assert verify(question_text(b), question_text(a)).accepted


CASED = [
    ("Which letters of HeLLo are capitals?", "Which letters of hello are capitals?"),
    ("Is HELLO written in block letters?", "Is hello written in block letters?"),
    ("Does aBC contain small letters?", "Does ABC contain small letters?"),
    ("Which letters of Hello are capitals?", "Which letters of hello are capitals?"),
    ("How many vowels does HeLLo have?", "How many vowels does hello have?"),
]


@pytest.mark.parametrize(("stored", "asked"), CASED)
async def test_a_word_in_another_case_misses_when_case_may_matter(
    make_cache: MakeCache, stored: str, asked: str
) -> None:
    """Bug: only questions with a listed case word compared case. A word written in capitals or
    with a capital inside is now compared as written whatever the wording, and more case words
    are known ("capitals", "block letters", "small letters")."""
    assert await _served(make_cache, stored, asked) is None


CASE_PARAPHRASES = [
    (
        "How do I convert a string to lowercase in JavaScript?",
        "How can I convert a string to lowercase in JavaScript?",
    ),
    ("How do I make a string uppercase in Python?", "How can I make a string uppercase in Python?"),
    ("How do i capitalize the first letter?", "How do I capitalize the first letter?"),
]


@pytest.mark.parametrize(("a", "b"), CASE_PARAPHRASES)
def test_a_question_about_case_still_meets_its_paraphrases(
    embedder: Embedder, a: str, b: str
) -> None:
    """Bug: a question about case compared every word as written, so any other wording was
    refused. Words are now paired case-insensitively; only a pair differing in case refuses."""
    verdict = verify(question_text(b), question_text(a), embedder.words.similarity)
    assert verdict.accepted, verdict.reason


def test_a_name_in_another_case_in_a_question_about_case_is_refused() -> None:
    """ "java" may be the word asked about: in a question about case it must be written alike."""
    a = "How do I capitalize the first letter in Java?"
    b = "how do I capitalize the first letter in java?"
    assert verify(question_text(b), question_text(a)).reason == "literal"


def test_spans_are_found_on_the_raw_message() -> None:
    """A message whose quoted spans normalizing would change, or with a quote left open, is
    exact only; a closed span, newline inside, is kept verbatim."""
    assert question_text("Does 'foo\nbar'  fit?") == "Does 'foo\nbar' fit"
    assert not exact_only("Does 'foo\nbar' fit?")
    assert exact_only('Is a 12" pizza big?')  # an inch mark: a lost hit, never a wrong one
    assert exact_only("Is “this quoted?")
    assert not exact_only("What's the students' favourite 'rock 'n' roll' song?")
    # Factorials the verifier cannot read: the subfactorial (!5 = 44), a bracket's.
    assert exact_only("What is !5") and exact_only("What is (2+3)!")
    assert not exact_only("What is 5!") and not exact_only("Hello!5 apples? Wow!")
