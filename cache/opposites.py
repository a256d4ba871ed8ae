"""Which words mean the opposite of which: the verifier's `antonym` check.

Two words are opposites when the lexicon lists them (`lexicon.OPPOSITES`, compared after
stemming) or puts them in two classes of one group of alternatives (`lexicon.ALTERNATIVES`:
"today" / "tomorrow", "during" / "after", "allowed" / "prohibited"), when one is the other with
a negating prefix ("install" / "uninstall"), when they are one word after the two prefixes of a
pair ("upload" / "download"), or when they are the same
derived form of listed opposites: comparatives, superlatives and agent nouns ("older" /
"younger" from old / young, "fastest" / "slowest", "buyer" / "seller"), so a listed pair covers
its "-er" and "-est" forms without listing each.

`has_opposites` generates each word's opposites and looks them up, so its work grows with the
number of words, not with the product of the two questions' words.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from loramux.cache.lexicon import (
    ALTERNATIVES,
    OPPOSITE_PREFIX_PAIRS,
    OPPOSITE_PREFIXES,
    OPPOSITES,
    stem,
)

DEGREES = ("er", "est")
"""Suffixes of comparatives, superlatives and agent nouns, as in "old-er", "old-est"."""


@functools.cache
def _listed() -> dict[str, frozenset[str]]:
    """Each listed word's stem -> the stems of its opposites (both directions): listed pairs,
    and the words of the other classes of its group of alternatives."""
    pairs = [
        (a, b)
        for group in ALTERNATIVES
        for n, one in enumerate(group)
        for other in group[n + 1 :]
        for a in one
        for b in other
    ]
    found: dict[str, set[str]] = {}
    for a, b in [*OPPOSITES, *pairs]:
        found.setdefault(stem(a), set()).add(stem(b))
        found.setdefault(stem(b), set()).add(stem(a))
    return {word: frozenset(others) for word, others in found.items()}


def _plain(word: str) -> str:
    """An adverb as its adjective ("slowly" -> "slow"), so listed adjectives cover both."""
    return word.removesuffix("ly") if len(word) > 5 else word


def _bases(word: str, suffix: str) -> set[str]:
    """What `word` may be the `suffix` form of: "bigger" -> big(g), "easier" -> easy."""
    root = word.removesuffix(suffix)
    if root == word or len(root) < 2:
        return set()
    bases = {root}
    if len(root) > 2 and root[-1] == root[-2]:
        bases.add(root[:-1])
    if root.endswith("i"):
        bases.add(root[:-1] + "y")
    return bases


def _derived(base: str, suffix: str) -> set[str]:
    """The ways `base` may be written with `suffix`: "old" -> older, "big" -> bigger, "easy" ->
    easier ("larg", the stem of "large", -> larger)."""
    forms = {base + suffix, base + base[-1] + suffix}
    if base.endswith("y"):
        forms.add(base[:-1] + "i" + suffix)
    return forms


def opposites_of(word: str) -> set[str]:
    """Every word (as `_plain` writes it) that is the opposite of `word` (a stem)."""
    word = _plain(word)
    listed = _listed()
    found = set(listed.get(word, ()))
    if len(word) >= 3:
        found |= {prefix + word for prefix in OPPOSITE_PREFIXES}
    found |= {
        word[len(p) :] for p in OPPOSITE_PREFIXES if word.startswith(p) and len(word) - len(p) >= 3
    }
    for pair in OPPOSITE_PREFIX_PAIRS:
        for x, y in (pair, pair[::-1]):
            if word.startswith(x) and len(word) - len(x) >= 3:
                found.add(y + word[len(x) :])
    for suffix in DEGREES:
        for base in _bases(word, suffix):
            for other in listed.get(base, ()):
                found |= _derived(other, suffix)
    return found


def has_opposites(only_a: Iterable[str], only_b: Iterable[str]) -> bool:
    """Whether a word of `only_a` is the opposite of a word of `only_b` (stems)."""
    b_words = {_plain(w) for w in only_b}
    return any(opposites_of(w) & b_words for w in only_a)
