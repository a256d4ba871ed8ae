"""The strict verifier: is a candidate question found by similarity really the same question?

Embedding similarity is blind to exactly what changes an answer: "convert 10 miles to km" and
"convert 10 km to miles", "delivered" and "not delivered", "open" and "close" score above 0.94
with all-MiniLM-L6-v2. The verifier compares the two questions' surface instead, in this order,
and names the first check that fails:

- `number`: the multisets of numbers (digits and number words, "15%" = "15 percent") differ;
- `negation`: one negates more often than the other ("not", "never", "without", "n't", …);
- `entity`: a capitalized word of one (a name, not a sentence's first word) is absent from the
  other, in any case ("Tokyo" / "Osaka"; "france" still matches "France");
- `antonym`: a word only one has is the opposite of a word only the other has ("increase" /
  "decrease", "install" / "uninstall", "zoom in" / "zoom out");
- `order`: the content words both share appear in another order ("miles to kilometers" /
  "kilometers to miles", "Rome defeat Carthage" / "Carthage defeat Rome");
- `wording`: a content word of one is missing from the other (a qualifier added, a word swapped:
  "international shipping", "pancakes" / "waffles").

What passes differs only in function words, phrasing, punctuation, case and inflection. The
verifier errs towards refusing: a refused paraphrase costs one generation, a wrong hit serves a
wrong answer.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass

from cache.lexicon import (
    CONTRACTIONS,
    NEGATIONS,
    NUMBER_WORDS,
    OPPOSITE_PREFIXES,
    OPPOSITES,
    STOPWORDS,
    SYMBOLS,
)

_WORD = re.compile(r"[^\W\d_]+|\d+(?:\.\d+)?|[%$€£+]")
_CASED_WORD = re.compile(r"[^\W\d_]+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_SENTENCE_END = ".!?:;\"'(["


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    """"ok", or the first failed check: number, negation, entity, antonym, order, wording."""


@dataclass(frozen=True)
class Question:
    """A question as the verifier compares it."""

    tokens: tuple[str, ...]
    """Lower-cased words after contraction expansion, symbols spelled out, stemmed."""
    numbers: tuple[float, ...]
    """Sorted."""
    negations: int
    entities: frozenset[str]
    """Lower-cased words written capitalized (not sentence-initially) or in capitals."""
    content: tuple[str, ...]
    """Stems of the meaning-bearing words and numbers (`#<value>`), in order, first occurrence."""


def stem(word: str) -> str:
    """A crude suffix stripper: enough to equate "closes", "closed", "closing" and "close"."""
    for suffix, replacement in (("ies", "y"), ("ied", "y"), ("ing", ""), ("ed", ""), ("es", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)] + replacement
            break
    else:
        if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
            word = word[:-1]
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


@functools.cache
def _opposites() -> frozenset[tuple[str, str]]:
    pairs = {(stem(a), stem(b)) for a, b in OPPOSITES}
    return frozenset(pairs | {(b, a) for a, b in pairs})


def _are_opposite(a: str, b: str) -> bool:
    if (a, b) in _opposites():
        return True
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    return any(longer == p + shorter for p in OPPOSITE_PREFIXES) and len(shorter) >= 3


def _lower_words(text: str) -> list[str]:
    text = _THOUSANDS.sub("", text.lower().replace("’", "'"))
    for contraction, expansion in CONTRACTIONS.items():
        text = text.replace(contraction, expansion)
    return [SYMBOLS.get(w, w) for w in _WORD.findall(text)]


def _entities(text: str) -> frozenset[str]:
    found = set()
    for match in _CASED_WORD.finditer(text):
        word = match.group()
        before = text[: match.start()].rstrip()
        initial = not before or before[-1] in _SENTENCE_END
        capitals = sum(c.isupper() for c in word)
        if word == "I" or capitals == 0 or (initial and capitals == 1 and word[0].isupper()):
            continue
        found.add(word.lower())
    return frozenset(found)


def _number(word: str) -> float | None:
    if word[0].isdigit():
        return float(word)
    value = NUMBER_WORDS.get(word)
    return None if value is None else float(value)


def _stems(words: list[str]) -> dict[str, str]:
    """Each word's stem, except that two different words of one text never share one
    ("http" and "https" in the same question stay apart)."""
    by_stem: dict[str, set[str]] = {}
    for word in words:
        by_stem.setdefault(stem(word), set()).add(word)
    return {w: s if len(ws) == 1 else w for s, ws in by_stem.items() for w in ws}


@functools.lru_cache(maxsize=4096)
def parse(text: str) -> Question:
    words = _lower_words(text)
    stems = _stems(words)
    numbers = []
    content: list[str] = []
    for word in words:
        value = _number(word)
        if value is not None:
            numbers.append(value)
            item = f"#{value:g}"
        elif word in STOPWORDS or word in NEGATIONS:
            continue
        else:
            item = stems[word]
        if item not in content:
            content.append(item)
    return Question(
        tokens=tuple(stems[w] for w in words),
        numbers=tuple(sorted(numbers)),
        negations=sum(w in NEGATIONS for w in words),
        entities=_entities(text),
        content=tuple(content),
    )


def verify(query: str, candidate: str) -> Verdict:
    """Whether the cached answer to `candidate` answers `query` (see the module docstring)."""
    a, b = parse(query), parse(candidate)
    if a.numbers != b.numbers:
        return Verdict(False, "number")
    if a.negations != b.negations:
        return Verdict(False, "negation")
    if not _entities_match(a, b):
        return Verdict(False, "entity")
    if _has_opposites(a, b):
        return Verdict(False, "antonym")
    shared = set(a.content) & set(b.content)
    if [w for w in a.content if w in shared] != [w for w in b.content if w in shared]:
        return Verdict(False, "order")
    if len(shared) != len(a.content) or len(shared) != len(b.content):
        return Verdict(False, "wording")
    return Verdict(True, "ok")


def _entities_match(a: Question, b: Question) -> bool:
    a_words = {w.lower() for w in a.tokens} | set(a.content)
    b_words = {w.lower() for w in b.tokens} | set(b.content)
    return all(stem(e) in b_words for e in a.entities) and all(
        stem(e) in a_words for e in b.entities
    )


def _has_opposites(a: Question, b: Question) -> bool:
    only_a = Counter(a.tokens) - Counter(b.tokens)
    only_b = Counter(b.tokens) - Counter(a.tokens)
    return any(_are_opposite(x, y) for x in only_a for y in only_b)
