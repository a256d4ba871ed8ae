"""The verifier: is a candidate question found by similarity really the same question?

Embedding similarity is blind to exactly what changes an answer: "convert 10 miles to km" and
"convert 10 km to miles", "delivered" and "not delivered", "open" and "close" score above 0.94
with all-MiniLM-L6-v2. The verifier compares the two questions' words instead, in this order,
and names the first check that fails:

- `length`: either has more than `MAX_CONTENT_WORDS` content words: such a question is not
  compared (the checks below cost up to the square of its words), and never hits;
- `literal`: the quoted and backticked spans (`keys.LITERAL`) differ in any character, case and
  whitespace included ("'a b'" / "'a  b'", "'Hello'" / "'hello'"), or a word of both (paired
  case-insensitively) is written in another case where case may matter: in capitals or with a
  capital inside ("HeLLo" / "hello", "COVID" / "covid"), or anywhere when one asks about letter
  case ("capitals", "uppercase", "small letters", …: "Hello" / "hello"); a sentence's first
  capital is no difference. The other checks read words lower-cased;
- `number`: the multisets of numbers (digits with their sign, number words, "15%" = "15 percent")
  or of operators differ (arithmetic: "12 / 4" / "12 * 4", "*" = "times", "5!" = "factorial";
  comparisons: "x < 5" / "x > 5", "<" = "less than"), or a "!" follows another number or is
  doubled ("5! + 3" / "5 + 3!", "5!!" / "5!"; `_factorials_match`);
- `negation`: one negates more often than the other ("not", "never", "without", "n't", …);
- `pronoun`: the third-person pronouns differ ("what did he say to her" / "what did she say to
  him": who is meant); "I" and "you" are phrasing;
- `choice`: one asks for a choice ("or") more often than the other ("aspirin or ibuprofen" /
  "aspirin with ibuprofen");
- `entity`: a capitalized word of one (a name, not a sentence's first word), or a day or month
  however written, is absent from the other, in any case ("Tokyo" / "Osaka"; "france" still
  matches "France"; "monday" / "tuesday");
- `unit`: the units and periods differ ("per month" / "per year", "Celsius" / "Fahrenheit";
  "annual" = "yearly");
- `antonym`: a word only one has is the opposite of a word only the other has ("increase" /
  "decrease", "install" / "uninstall", "zoom in" / "zoom out", "older" / "younger"), or of
  another class of its group of alternatives ("today" / "tomorrow", "during" / "after",
  "allowed" / "prohibited", "child" / "adult"), which word vectors would take for synonyms;
  `cache.opposites`);
- `wording`: a content word of one has no counterpart in the other — neither the same word nor,
  when word vectors are given, a word at least `word_threshold` similar ("annual" meets
  "yearly", "modify" meets "change"; an added qualifier such as "international" meets nothing);
- `relation`: two matched words swap places across a word that relates them ("dollars to
  euros" / "euros to dollars", "5 km in miles" / "5 miles in km", "10 by 2" / "2 by 10",
  "Rome defeat Carthage" / "Carthage defeat Rome"). Clauses moved
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
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loramux.cache.keys import LITERAL
from loramux.cache.lexicon import (
    CALENDAR,
    CONTRACTIONS,
    DISJUNCTIONS,
    FRAME_WORDS,
    NEGATIONS,
    NUMBER_WORDS,
    RELATION_WORDS,
    STOPWORDS,
    SYMBOLS,
    THIRD_PERSON,
    UNITS,
    operator_at,
    stem,
)
from loramux.cache.opposites import has_opposites

_WORD = re.compile(
    r"(?<![\w.])[-−]\d+(?:\.\d+)?"  # a signed number: "-40", not "COVID-19" or "3-5"
    r"|\d+(?:\.\d+)?"
    r"|[^\W\d_]+"
    r"|(?<=\s)[-−](?=\s+\d)"  # minus, spaced: "10 - 3" (unspaced, a range: _RANGE)
    r"|(?<=[\d\s])[/⁄](?=\s*\d)|(?<=\d)[/⁄]"  # divided, next to a number: "12/4", "x / 2"
    r"|\*\*|[%$€£+*×÷^]"
    r"|[<>=]=|<>|[<>=≤≥≠]"  # comparisons: "x < 5", "x != 5" (`lexicon.COMPARISONS`)
    r"|(?<=\d)!+"  # factorial: "5!", double factorial "5!!" (one token, `_factorials`)
    r"|[,;:]"
)
_CASED_WORD = re.compile(r"[^\W\d_]+")
_ABOUT_CASE = re.compile(
    r"\b(?:upper|lower|title|camel|snake|pascal|kebab|sentence)[ -]?case|\bcase\b"
    r"|\bcase[ -]?(?:in)?sensitiv|\bcapitali[sz]|\bcapital letter|\bcapitals\b|\bcaps\b"
    r"|\b(?:block|small|big|large|lower|upper)[ -]?letter|\b(?:ma|mi)juscule|\bminuscule",
    re.IGNORECASE,
)
"""A question about letter case: "capital letter", "capitals", "uppercase", "capitalized",
"case-sensitive", "block letters", "small letters", "caps", any "case" (not "the capital of
France"). Such a question refuses any word whose case differs (`_case_differs`); a word written
in capitals or with a capital inside is refused whatever the wording."""
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_RANGE = re.compile(r"(?<=\d)[-−](?=\d)")
"""An unspaced hyphen between numbers, read as "to": "3-5 cups" is "3 to 5 cups", and "10-3"
against "3-10" is a relation reversed (dropping the hyphen made them equal: a wrong hit)."""
_SENTENCE_END = ".!?:;\"'(["
_CLAUSE_BREAK = frozenset(",;:")

WordSimilarity = Callable[[Sequence[str], Sequence[str]], npt.NDArray[np.float32]]
"""Cosine similarities of two lists of words, as a len(a) × len(b) matrix."""

DEFAULT_WORD_THRESHOLD = 0.5

MAX_CONTENT_WORDS = 64
"""Questions with more content words are refused unverified (`length`). The labelled questions
have at most 8; the relation check compares up to n(n-1)/2 pairs of them, in constant time each."""


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str
    """"ok", or the first failed check: length, literal, number, negation, pronoun, choice, entity, unit,
    antonym, wording, relation."""
    substitutions: tuple[float, ...] = ()
    """Similarities of the content words matched to a different word (on acceptance)."""
    compared: int = 0
    """Pairs of matched words the relation check compared: the work that grows fastest with the
    question, at most `MAX_CONTENT_WORDS`² / 2."""


@dataclass(frozen=True)
class Question:
    """A question as the verifier compares it."""

    tokens: tuple[str, ...]
    """Lower-cased words after contraction expansion, symbols spelled out, stemmed."""
    numbers: tuple[float, ...]
    """Sorted, signed."""
    operators: tuple[str, ...]
    """Sorted arithmetic and comparison operators (`lexicon.operator_at`)."""
    negations: int
    persons: tuple[str, ...]
    """Sorted third-person pronouns (`lexicon.THIRD_PERSON`)."""
    choices: int
    """How often it asks for a choice (`lexicon.DISJUNCTIONS`)."""
    entities: frozenset[str]
    """Lower-cased words written capitalized (not sentence-initially) or in capitals, and days
    and months however written."""
    units: tuple[str, ...]
    """Sorted unit names (`lexicon.UNITS`)."""
    content: tuple[str, ...]
    """Stems of the meaning-bearing words, numbers (`#<value>`), unit and operator names, in
    order, first occurrence."""
    words: tuple[str, ...]
    """The lower-cased word each `content` stem was first written as."""
    places: tuple[int, ...]
    """Where each `content` stem first occurs in `sequence`."""
    sequence: tuple[str, ...]
    """Stems in order with clause breaks (",", ";", ":") kept: what `relation` reads."""
    literals: tuple[str, ...] = ()
    """Quoted and backticked spans, verbatim, in order (`keys.LITERAL`)."""
    cased: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Each word, lower-cased, with how it is written (sorted; a sentence-initial capital, and
    "I", as lower case): what `_case_differs` compares."""
    about_case: bool = False
    """It asks about letter case (`_ABOUT_CASE`)."""
    factorials: tuple[str, ...] = ()
    """When a "!" follows a digit: every number in order, with the "!"s written after it
    ("5!", "3", "5!!"); else empty. What `_factorials_match` compares."""


def _lower_words(text: str) -> list[str]:
    """Words, numbers, symbols and clause breaks, lower-cased and contractions expanded."""
    text = _THOUSANDS.sub("", text.lower().replace("’", "'"))
    text = _RANGE.sub(" to ", text).replace("!=", " ≠ ")  # "x != 5", not a factorial
    for contraction, expansion in CONTRACTIONS.items():
        text = text.replace(contraction, expansion)
    # A run of "!" after a digit stays as written: `parse` attaches it to its number first.
    return [w if w[0] == "!" else SYMBOLS.get(w, w) for w in _WORD.findall(text)]


def _plain_spellings(text: str) -> list[tuple[str, bool]]:
    """Each word as written, and whether its case is plain: no capital, or only a capital
    first letter at a sentence's start, or "I"."""
    found = []
    for match in _CASED_WORD.finditer(text):
        word = match.group()
        before = match.start() - 1
        while before >= 0 and text[before].isspace():
            before -= 1
        initial = before < 0 or text[before] in _SENTENCE_END
        capitals = sum(c.isupper() for c in word)
        plain = word == "I" or capitals == 0 or (initial and capitals == 1 and word[0].isupper())
        found.append((word, plain))
    return found


def _entities(text: str) -> frozenset[str]:
    return frozenset(word.lower() for word, plain in _plain_spellings(text) if not plain)


def _cased(text: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each word, lower-cased, with its spellings (plain ones lower-cased), sorted."""
    spellings: dict[str, set[str]] = {}
    for word, plain in _plain_spellings(text):
        spellings.setdefault(word.lower(), set()).add(word.lower() if plain else word)
    return tuple(sorted((word, tuple(sorted(ways))) for word, ways in spellings.items()))


def _marked(spelling: str) -> bool:
    """Written in capitals or with a capital inside ("HELLO", "HeLLo", "aBC"): its case is
    deliberate, whatever the question asks."""
    return len(spelling) > 1 and any(c.isupper() for c in spelling[1:])


def _case_differs(a: Question, b: Question) -> bool:
    """A word of both written in another case: any such word when either asks about letter
    case, else a word written in capitals or with a capital inside in either (`_marked`).
    Words are paired case-insensitively, so other wording is left to the later checks."""
    strict = a.about_case or b.about_case
    ways_a, ways_b = dict(a.cased), dict(b.cased)
    for word in ways_a.keys() & ways_b.keys():
        if ways_a[word] != ways_b[word] and (
            strict or any(map(_marked, (*ways_a[word], *ways_b[word])))
        ):
            return True
    return False


def _factorials(written: list[str]) -> tuple[str, ...]:
    """The numbers of `written` in order, each with the "!"s after it, when any has one."""
    if not any(w[0] == "!" for w in written):
        return ()
    found: list[str] = []
    for word in written:
        if word[0] == "!" and found:
            found[-1] += word
            continue
        value = None if word in _CLAUSE_BREAK else _number(word)
        if value is not None:
            found.append(f"{value:g}")
    return tuple(found)


def _factorials_match(a: Question, b: Question) -> bool:
    """The same numbers with the same "!"s, in the same order ("5! + 3" is not "5 + 3!", "5!!"
    not "5!"); or each has one number and one operator, a single factorial ("5!", "the factorial
    of 5")."""
    if a.factorials == b.factorials:
        return True

    def lone(q: Question) -> bool:
        single = (f"{q.numbers[0]:g}!",) if len(q.numbers) == 1 else None
        return q.operators == ("factorial",) and q.factorials in ((), single)

    return lone(a) and lone(b)


def _number(word: str) -> float | None:
    if word[0].isdigit() or (len(word) > 1 and word[0] in "-−"):
        return float(word.replace("−", "-"))
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
    """`text` (as `keys.question_text` leaves it) as the verifier compares it."""
    literals = tuple(m.group() for m in LITERAL.finditer(text))
    cased, about_case = _cased(text), _ABOUT_CASE.search(text) is not None
    # Compatibility forms as their plain letters and digits: "x²" is "x2", "½" is "1⁄2".
    text = unicodedata.normalize("NFKC", text)
    written = _lower_words(text)
    factorials = _factorials(written)
    written = [f for w in written for f in (["factorial"] * len(w) if w[0] == "!" else [w])]
    words = [w for w in written if w not in _CLAUSE_BREAK]
    stems = _stems(words)
    sequence = [w if w in _CLAUSE_BREAK else stems[w] for w in written]
    numbers, units, operators = [], [], []
    content: dict[str, tuple[str, int]] = {}
    for place, word in enumerate(written):
        value = None if word in _CLAUSE_BREAK else _number(word)
        if value is not None:
            numbers.append(value)
            content.setdefault(f"#{value:g}", (f"#{value:g}", place))
        elif word in UNITS:
            units.append(UNITS[word])
            content.setdefault(UNITS[word], (UNITS[word], place))
        elif (operator := operator_at(written, place)) is not None:
            operators.append(operator)
            content.setdefault(operator, (operator, place))
        elif word in _CLAUSE_BREAK or word in STOPWORDS or word in NEGATIONS:
            continue
        elif content or word not in FRAME_WORDS:
            content.setdefault(stems[word], (word, place))
    return Question(
        tokens=tuple(stems[w] for w in words),
        numbers=tuple(sorted(numbers)),
        operators=tuple(sorted(operators)),
        negations=sum(w in NEGATIONS for w in words),
        persons=tuple(sorted(w for w in words if w in THIRD_PERSON)),
        choices=sum(w in DISJUNCTIONS for w in words),
        entities=_entities(text) | {w for w in words if stem(w) in CALENDAR},
        units=tuple(sorted(units)),
        content=tuple(content),
        words=tuple(word for word, _ in content.values()),
        places=tuple(place for _, place in content.values()),
        sequence=tuple(sequence),
        literals=literals,
        cased=cased,
        about_case=about_case,
        factorials=factorials,
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
    if max(len(a.content), len(b.content)) > MAX_CONTENT_WORDS:
        return Verdict(False, "length")
    if a.literals != b.literals or _case_differs(a, b):
        return Verdict(False, "literal")
    if a.numbers != b.numbers or a.operators != b.operators or not _factorials_match(a, b):
        return Verdict(False, "number")
    if a.negations != b.negations:
        return Verdict(False, "negation")
    if a.persons != b.persons:
        return Verdict(False, "pronoun")
    if a.choices != b.choices:
        return Verdict(False, "choice")
    if not _entities_match(a, b):
        return Verdict(False, "entity")
    if a.units != b.units:
        return Verdict(False, "unit")
    if has_opposites(Counter(a.tokens) - Counter(b.tokens), Counter(b.tokens) - Counter(a.tokens)):
        return Verdict(False, "antonym")
    matches = align(a, b, similarity, word_threshold)
    if len(matches) != len(a.content) or len(matches) != len(b.content):
        return Verdict(False, "wording")
    reversed_, compared = _relation_reversed(a, b, matches)
    if reversed_:
        return Verdict(False, "relation", compared=compared)
    substitutions = tuple(sorted(s for s in matches.values() if s < 1.0))
    return Verdict(True, "ok", substitutions, compared)


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


def _relation_reversed(
    a: Question, b: Question, matches: dict[tuple[int, int], float]
) -> tuple[bool, int]:
    """Two matched words in the opposite order, with the same relation between them in both
    questions: a relation word, or a third matched word, in both spans, and no clause break;
    and how many pairs of matched words were compared.

    Each pair costs constant time: what a span holds is read from running counts, and the
    matched words between the two (in `a`) are gathered as the second word moves right."""
    pairs = sorted(matches, key=lambda m: a.places[m[0]])
    relations = sorted(RELATION_WORDS & set(a.sequence) & set(b.sequence))
    count_a = _running_counts(a.sequence, relations)
    count_b = _running_counts(b.sequence, relations)
    compared = 0
    for n, (i1, j1) in enumerate(pairs):
        start_a, end_b = a.places[i1] + 1, b.places[j1]
        inside = -1  # the rightmost b place, left of `end_b`, of a matched word passed in `a`
        for i2, j2 in pairs[n + 1 :]:
            compared += 1
            end_a, start_b = a.places[i2], b.places[j2] + 1
            if _holds(count_a, _CLAUSE, start_a, end_a):
                break  # every later span of `a` holds this clause break too
            if start_b <= end_b and not _holds(count_b, _CLAUSE, start_b, end_b):
                bridge = any(
                    _holds(count_a, w, start_a, end_a) and _holds(count_b, w, start_b, end_b)
                    for w in relations
                )
                if bridge or inside >= start_b:
                    return True, compared
            if b.places[j2] < end_b:
                inside = max(inside, b.places[j2])
    return False, compared


_CLAUSE = "<clause>"
"""The running count of any clause break (`_CLAUSE_BREAK`)."""


def _running_counts(sequence: Sequence[str], words: Sequence[str]) -> dict[str, list[int]]:
    """For `_CLAUSE` and each of `words`: how many of `sequence[:k]` it is, for every k."""
    counts: dict[str, list[int]] = {}
    for word in (_CLAUSE, *words):
        running, total = [0], 0
        for w in sequence:
            total += w in _CLAUSE_BREAK if word == _CLAUSE else w == word
            running.append(total)
        counts[word] = running
    return counts


def _holds(counts: dict[str, list[int]], word: str, start: int, end: int) -> bool:
    """Whether `word` occurs in `sequence[start:end]` (`_running_counts`)."""
    return end > start and counts[word][end] > counts[word][start]


def _entities_match(a: Question, b: Question) -> bool:
    a_words = {w.lower() for w in a.tokens} | set(a.content)
    b_words = {w.lower() for w in b.tokens} | set(b.content)
    return all(stem(e) in b_words for e in a.entities) and all(
        stem(e) in a_words for e in b.entities
    )
