"""The verifier: is a candidate question found by similarity really the same question?

Embedding similarity is blind to exactly what changes an answer: "convert 10 miles to km" and
"convert 10 km to miles", "delivered" and "not delivered", "open" and "close" score above 0.94
with all-MiniLM-L6-v2. The verifier compares the two questions' words instead, in this order,
and names the first check that fails:

- `number`: the multisets of numbers (digits and number words, "15%" = "15 percent") differ;
- `negation`: one negates more often than the other ("not", "never", "without", "n't", …);
- `entity`: a capitalized word of one (a name, not a sentence's first word) is absent from the
  other, in any case ("Tokyo" / "Osaka"; "france" still matches "France");
- `unit`: the units and periods differ ("per month" / "per year", "Celsius" / "Fahrenheit";
  "annual" = "yearly");
- `antonym`: a word only one has is the opposite of a word only the other has ("increase" /
  "decrease", "install" / "uninstall", "zoom in" / "zoom out");
- `wording`: a content word of one has no counterpart in the other — neither the same word nor,
  when word vectors are given, a word at least `word_threshold` similar ("annual" meets
  "yearly", "modify" meets "change"; an added qualifier such as "international" meets nothing);
- `relation`: two matched words swap places across a word that relates them ("dollars to
  euros" / "euros to dollars", "Rome defeat Carthage" / "Carthage defeat Rome"). Clauses moved
  whole ("For a sore throat, what works?" / "What works for a sore throat?") and the passive
  voice ("Who discovered X?" / "By whom was X discovered?") move words without relating them
  anew, and pass.

What passes differs only in function words, phrasing, punctuation, case, inflection and, with
word vectors, in synonyms. The verifier errs towards refusing: a refused paraphrase costs one
generation, a wrong hit serves a wrong answer.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loramux.cache.lexicon import (
    CONTRACTIONS,
    FRAME_WORDS,
    NEGATIONS,
    NUMBER_WORDS,
    OPPOSITE_PREFIX_PAIRS,
    OPPOSITE_PREFIXES,
    OPPOSITES,
    RELATION_WORDS,
    STOPWORDS,
    SYMBOLS,
    UNITS,
)

_WORD = re.compile(r"[^\W\d_]+|\d+(?:\.\d+)?|[%$€£+]|[,;:]")
_CASED_WORD = re.compile(r"[^\W\d_]+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_SENTENCE_END = ".!?:;\"'(["
_CLAUSE_BREAK = frozenset(",;:")

WordSimilarity = Callable[[Sequence[str], Sequence[str]], npt.NDArray[np.float32]]
"""Cosine similarities of two lists of words, as a len(a) × len(b) matrix."""

DEFAULT_WORD_THRESHOLD = 0.5


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    """"ok", or the first failed check: number, negation, entity, unit, antonym, wording,
    relation."""
    substitutions: tuple[float, ...] = ()
    """Similarities of the content words matched to a different word (on acceptance)."""


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
    units: tuple[str, ...]
    """Sorted unit names (`lexicon.UNITS`)."""
    content: tuple[str, ...]
    """Stems of the meaning-bearing words, numbers (`#<value>`) and unit names, in order, first
    occurrence."""
    words: tuple[str, ...]
    """The lower-cased word each `content` stem was first written as."""
    places: tuple[int, ...]
    """Where each `content` stem first occurs in `sequence`."""
    sequence: tuple[str, ...]
    """Stems in order with clause breaks (",", ";", ":") kept: what `relation` reads."""


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
    """Listed opposites (also as adverbs: "slowly" / "fast"), a word and its negating prefix
    ("install" / "uninstall"), or one word after opposite prefixes ("upload" / "download")."""
    a, b = (w.removesuffix("ly") if len(w) > 5 else w for w in (a, b))
    if (a, b) in _opposites():
        return True
    longer, shorter = (a, b) if len(a) > len(b) else (b, a)
    if len(shorter) >= 3 and any(longer == p + shorter for p in OPPOSITE_PREFIXES):
        return True
    return any(
        a.startswith(x) and b.startswith(y) and a[len(x) :] == b[len(y) :] and len(a) - len(x) >= 3
        for p in OPPOSITE_PREFIX_PAIRS
        for x, y in (p, p[::-1])
    )


def _lower_words(text: str) -> list[str]:
    """Words, numbers, symbols and clause breaks, lower-cased and contractions expanded."""
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
    written = _lower_words(text)
    words = [w for w in written if w not in _CLAUSE_BREAK]
    stems = _stems(words)
    sequence = [w if w in _CLAUSE_BREAK else stems[w] for w in written]
    numbers, units = [], []
    content: dict[str, tuple[str, int]] = {}
    for place, word in enumerate(written):
        value = None if word in _CLAUSE_BREAK else _number(word)
        if value is not None:
            numbers.append(value)
            content.setdefault(f"#{value:g}", (f"#{value:g}", place))
        elif word in UNITS:
            units.append(UNITS[word])
            content.setdefault(UNITS[word], (UNITS[word], place))
        elif word in _CLAUSE_BREAK or word in STOPWORDS or word in NEGATIONS:
            continue
        elif content or word not in FRAME_WORDS:
            content.setdefault(stems[word], (word, place))
    return Question(
        tokens=tuple(stems[w] for w in words),
        numbers=tuple(sorted(numbers)),
        negations=sum(w in NEGATIONS for w in words),
        entities=_entities(text),
        units=tuple(sorted(units)),
        content=tuple(content),
        words=tuple(word for word, _ in content.values()),
        places=tuple(place for _, place in content.values()),
        sequence=tuple(sequence),
    )


def verify(
    query: str,
    candidate: str,
    similarity: WordSimilarity | None = None,
    word_threshold: float = DEFAULT_WORD_THRESHOLD,
) -> Verdict:
    """Whether the cached answer to `candidate` answers `query` (see the module docstring).
    Without `similarity`, a content word matches only the same word."""
    a, b = parse(query), parse(candidate)
    if a.numbers != b.numbers:
        return Verdict(False, "number")
    if a.negations != b.negations:
        return Verdict(False, "negation")
    if not _entities_match(a, b):
        return Verdict(False, "entity")
    if a.units != b.units:
        return Verdict(False, "unit")
    if _has_opposites(a, b):
        return Verdict(False, "antonym")
    matches = align(a, b, similarity, word_threshold)
    if len(matches) != len(a.content) or len(matches) != len(b.content):
        return Verdict(False, "wording")
    if _relation_reversed(a, b, matches):
        return Verdict(False, "relation")
    return Verdict(True, "ok", tuple(sorted(s for s in matches.values() if s < 1.0)))


def align(
    a: Question, b: Question, similarity: WordSimilarity | None, word_threshold: float
) -> dict[tuple[int, int], float]:
    """Pairs (i, j) of a content word of `a` and its counterpart in `b`, one to one, with their
    similarity: the same stem first (1.0), then the most similar remaining pairs down to
    `word_threshold`."""
    matches = {(i, b.content.index(s)): 1.0 for i, s in enumerate(a.content) if s in b.content}
    taken_a, taken_b = {i for i, _ in matches}, {j for _, j in matches}
    left_a = [i for i in range(len(a.content)) if i not in taken_a]
    left_b = [j for j in range(len(b.content)) if j not in taken_b]
    if similarity is None or not left_a or not left_b:
        return matches
    scores = similarity([a.words[i] for i in left_a], [b.words[j] for j in left_b])
    for flat in np.argsort(-scores, axis=None):
        x, y = divmod(int(flat), len(left_b))
        if scores[x, y] < word_threshold:
            break
        i, j = left_a[x], left_b[y]
        if i not in taken_a and j not in taken_b:
            matches[i, j] = min(float(scores[x, y]), 0.999)
            taken_a.add(i)
            taken_b.add(j)
    return matches


def _relation_reversed(a: Question, b: Question, matches: dict[tuple[int, int], float]) -> bool:
    """Two matched words in the opposite order, with the same relation between them in both
    questions: a relation word, or a third matched word, in both spans, and no clause break."""
    pairs = sorted(matches, key=lambda m: a.places[m[0]])
    partner = dict(pairs)
    for n, (i1, j1) in enumerate(pairs):
        for i2, j2 in pairs[n + 1 :]:
            if b.places[j1] < b.places[j2]:
                continue
            span_a = a.sequence[a.places[i1] + 1 : a.places[i2]]
            span_b = b.sequence[b.places[j2] + 1 : b.places[j1]]
            if _CLAUSE_BREAK & (set(span_a) | set(span_b)):
                continue
            bridge = {w for w in span_a if w in RELATION_WORDS} & set(span_b)
            inside_a = {i for i, _ in pairs if a.places[i1] < a.places[i] < a.places[i2]}
            bridged = any(b.places[j2] < b.places[partner[i]] < b.places[j1] for i in inside_a)
            if bridge or bridged:
                return True
    return False


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
