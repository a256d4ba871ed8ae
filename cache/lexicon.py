"""Word lists of the strict verifier (English): what carries no meaning of its own in a question,
what negates, what counts, and what means the opposite; and the stemmer they are compared under.

General-purpose English lists (function words, question phrasing, common opposites), not the
benchmark's pairs; the verifier is conservative with them: when unsure it refuses the hit.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    return text.split()


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


STOPWORDS = frozenset(
    _words(
        """
    a an the this that these those it its it's they them their there here i me my mine we us our
    you your yours he him his she her hers one ones
    is are was were be been being am do does did done doing have has had having will would shall
    should can could may might must
    what which who whom whose when where why how whats
    and or but if then so as than too very just also
    of at by for with about into onto from to in on out up over under again further once
    some any all each every both few more most other such only own same
    please thanks thank hi hello hey
    tell explain describe say know want like need help wondering wonder give show me
    exactly actually really basically usually typically generally normally simply quite
    possible way ways able
    s t
    could would kindly sorry bother hope well quick quickly question curious just wondering
    appreciated appreciate much advice mind chance
    """
    )
)
"""Function words and question phrasing: not content words. Opposites among them ("in" /
"out") are still caught, by the antonym check over all words."""

FRAME_WORDS = frozenset(_words("walk teach list name suggest recommend provide write find"))
"""Verbs that frame a request ("List the planets…", "Can you recommend…") when they are the first
word that is not a stopword; anywhere else they are content ("convert a list to a string")."""

NEGATIONS = frozenset(_words("not no never none nobody nothing neither nor without cannot nowhere"))

CONTRACTIONS = {
    "won't": "will not",
    "can't": "can not",
    "cannot": "can not",
    "shan't": "shall not",
    "n't": " not",
    "'re": " are",
    "'ll": " will",
    "'ve": " have",
    "'m": " am",
    "'d": " would",
    "'s": "",
}
"""Applied in order to lower-cased text (`'s` is dropped: "what's" and "car's" alike)."""

NUMBER_WORDS = {
    "zero": 0,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
    "hundred": 100,
    "thousand": 1000,
    "million": 10**6,
    "billion": 10**9,
    "dozen": 12,
    "half": 0.5,
    "twice": 2,
    "double": 2,
    "triple": 3,
}

SYMBOLS = {
    "%": "percent",
    "$": "dollar",
    "€": "euro",
    "£": "pound",
    "+": "plus",
    "-": "minus",
    "−": "minus",
    "*": "times",
    "×": "times",
    "/": "divided",
    "⁄": "divided",
    "÷": "divided",
    "^": "power",
    "**": "power",
    "!": "factorial",
}
"""Symbols as the words they are read as; "-" and "/" only where the verifier reads them as
operators (between numbers: "10 - 3", "12/4"), and "!" only after a digit ("5!")."""

OPERATORS = {
    word: operator
    for operator, words in {
        "plus": "plus",
        "minus": "minus",
        "times": "times multiplied",
        "divided": "divided",
        "modulo": "modulo mod",
        "factorial": "factorial",
    }.items()
    for word in words.split()
}
"""Arithmetic operators, to one name each: "12 * 4", "12 times 4" and "12 multiplied by 4" ask the
same, "12 / 4" another question. ("^" is read as "power", a content word, so "2^10" meets "2 to the
power of 10".)"""

COMPARISONS = {
    "<": "<",
    ">": ">",
    "<=": "<=",
    "≤": "<=",
    ">=": ">=",
    "≥": ">=",
    "=": "=",
    "==": "=",
    "!=": "!=",
    "≠": "!=",
    "<>": "!=",
}
"""Comparison operators, to one name each; operators like the arithmetic ones (`OPERATORS`):
"Is x < 5?" is not "Is x > 5?"."""

COMPARATIVES = {
    word: operator
    for operator, words in {
        "<": "less fewer smaller lower",
        ">": "greater more larger bigger higher",
    }.items()
    for word in words.split()
}
"""Comparatives read as the comparison operator when "than" follows ("3 greater than 5" is
"3 > 5", not "3 less than 5"); elsewhere they are words ("more details")."""


def operator_at(words: list[str], place: int) -> str | None:
    """The operator `words[place]` is read as, if any: arithmetic (`OPERATORS`), a comparison
    (`COMPARISONS`), or a comparative before "than" (`COMPARATIVES`: "greater than" is ">")."""
    word = words[place]
    if word in COMPARATIVES and words[place + 1 : place + 2] == ["than"]:
        return COMPARATIVES[word]
    return OPERATORS.get(word) or COMPARISONS.get(word)


THIRD_PERSON = frozenset(
    _words("he him his himself she her hers herself they them their theirs themselves")
)
"""Pronouns that say who is meant: "what did he say to her" is not "what did she say to him".
First and second person ("how do I…", "how do you…") are phrasing, and stay stopwords."""

DISJUNCTIONS = frozenset(_words("or either"))
"""Words that ask for a choice: "aspirin or ibuprofen" is not "aspirin with ibuprofen"."""

CALENDAR = frozenset(
    _words(
        """
    monday tuesday wednesday thursday friday saturday sunday january february april june july
    august september october november december
    """
    )
)
"""Days and months: names, however written ("open on monday" is not "open on tuesday"). "May" and
"March" count only when capitalized, like other names, as lower-cased they are a verb."""

FUNCTION_OPPOSITES = [
    ("in", "out"),
    ("up", "down"),
    ("on", "off"),
    ("before", "after"),
    ("above", "below"),
    ("over", "under"),
    ("more", "less"),
    ("most", "least"),
    ("with", "without"),
    ("into", "from"),
    ("to", "from"),
]
"""Opposites among stopwords: "zoom in" / "zoom out", "turn on" / "turn off"."""

OPPOSITES = [
    *FUNCTION_OPPOSITES,
    *(
        tuple(pair.split("/"))
        for pair in _words(
            """
    open/close open/closed sink/float upgrade/downgrade open/shut start/stop start/end begin/end first/last early/late
    earliest/latest increase/decrease raise/lower rise/fall grow/shrink add/remove add/delete
    add/subtract plus/minus multiply/divide insert/delete create/delete create/destroy
    enable/disable allow/deny allow/block accept/reject accept/decline include/exclude
    show/hide visible/hidden buy/sell import/export upload/download push/pull send/receive
    give/take lend/borrow win/lose won/lost pass/fail true/false yes/no right/wrong correct/wrong
    max/min maximum/minimum largest/smallest biggest/smallest big/small large/small high/low
    higher/lower highest/lowest long/short longer/shorter longest/shortest tall/short
    fast/slow faster/slower quick/slow quickly/slowly hot/cold warm/cool warmer/cooler
    heat/cool boiling/freezing boil/freeze melt/freeze light/dark light/heavy full/empty
    wet/dry old/new oldest/newest young/old cheap/expensive good/bad best/worst
    better/worse easy/hard easy/difficult simple/complex safe/dangerous safe/unsafe
    healthy/unhealthy legal/illegal possible/impossible positive/negative plus/minus
    advantage/disadvantage pro/con pros/cons benefit/drawback strength/weakness love/hate
    like/dislike agree/disagree north/south east/west left/right top/bottom front/back
    inside/outside inner/outer internal/external input/output ascending/descending
    asc/desc forward/backward before/after past/future arrive/depart arrival/departure
    enter/exit entry/exit login/logout log/logout online/offline connect/disconnect
    mount/unmount lock/unlock encrypt/decrypt encode/decode compress/decompress zip/unzip
    serialize/deserialize install/uninstall subscribe/unsubscribe follow/unfollow
    mute/unmute pause/resume pause/play attach/detach link/unlink pin/unpin block/unblock
    freeze/unfreeze archive/unarchive minimize/maximize expand/collapse
    zoom/unzoom import/export inbound/outbound incoming/outgoing debit/credit deposit/withdraw
    deposit/withdrawal income/expense profit/loss asset/liability gain/loss rich/poor
    increase/reduce raise/cut strong/weak stronger/weaker win/defeat attack/defend
    male/female man/woman boy/girl husband/wife mother/father day/night morning/evening
    summer/winter spring/autumn spring/fall sunrise/sunset odd/even lowercase/uppercase
    sync/async synchronous/asynchronous public/private read/write
    accept/refuse approve/reject approve/deny permit/forbid always/never all/none many/few
    majority/minority success/failure successful/unsuccessful rich/poor present/absent
    """
        )
    ),
    *(
        tuple(pair.split("/"))
        for pair in _words(
            """
    parent/child ancestor/descendant predecessor/successor host/guest client/server
    master/slave leader/follower teacher/student employer/employee landlord/tenant
    creditor/debtor plaintiff/defendant caller/callee numerator/denominator
    """
        )
    ),
]
"""Pairs that mean opposite things, then the two sides of one relation (a parent's child is
not its parent); compared after stemming (`stem`). Their "-er"/"-est" forms ("older" /
"younger") are opposites too (`cache.opposites`)."""

ALTERNATIVES = [
    [_words(words) for words in group.split("|")]
    for group in (
        "yesterday | today tonight | tomorrow",
        "last previous past | this current | next upcoming",
        "morning | afternoon | evening | night tonight",
        "before prior | during while throughout | after following",
        "including include | except excluding besides",
        "allow allowed permit permitted authorize authorized legal"
        " | forbid forbidden prohibit prohibited ban banned disallow illegal",
        "baby babies infant infants newborn toddler | child children kid kids"
        " | teen teens teenager teenagers adolescent | adult adults grownup"
        " | elderly senior seniors",
    )
]
"""Classes of words that exclude each other: relative days and periods, times of day, the order
of two events, inclusion, permission and ages. A word of one class is the opposite of a word of
another class of its group ("today" / "tomorrow", "during" / "after", "allowed" /
"prohibited", "child" / "adult"), however close their word vectors sit: the wording check would
take them for synonyms."""

OPPOSITE_PREFIX_PAIRS = (
    ("up", "down"),
    ("in", "out"),
    ("over", "under"),
    ("pre", "post"),
    ("super", "sub"),
)
"""`upload` / `download`, `superclass` / `subclass`: the same word after each prefix of a pair."""

OPPOSITE_PREFIXES = ("un", "dis", "de", "in", "im", "il", "ir", "non", "anti", "counter")
"""`install` / `uninstall`, `connect` / `disconnect`: a word and the same word with one of
these prefixes are opposites."""


UNITS = {
    word: unit
    for unit, words in {
        "second": "second seconds sec secs",
        "millisecond": "millisecond milliseconds ms",
        "minute": "minute minutes min mins",
        "hour": "hour hours hourly",
        "day": "day days daily",
        "week": "week weeks weekly",
        "weekday": "weekday weekdays",
        "weekend": "weekend weekends",
        "month": "month months monthly",
        "quarter": "quarter quarters quarterly",
        "year": "year years yearly annual annually",
        "decade": "decade decades",
        "century": "century centuries",
        "meter": "meter meters metre metres",
        "kilometer": "kilometer kilometers kilometre kilometres km",
        "centimeter": "centimeter centimeters cm",
        "mile": "mile miles",
        "foot": "foot feet ft",
        "inch": "inch inches",
        "gram": "gram grams g",
        "kilogram": "kilogram kilograms kg kilo kilos",
        "pound": "pound pounds lb lbs",
        "ounce": "ounce ounces oz",
        "liter": "liter liters litre litres",
        "milliliter": "milliliter milliliters ml",
        "gallon": "gallon gallons",
        "celsius": "celsius centigrade",
        "fahrenheit": "fahrenheit",
        "kelvin": "kelvin",
        "degree": "degree degrees",
        "radian": "radian radians",
        "gradian": "gradian gradians",
        "megabyte": "megabyte megabytes mb",
        "gigabyte": "gigabyte gigabytes gb",
        "mbps": "mbps",
    }.items()
    for word in words.split()
}
"""Units of measure and periods of time, to one name per unit: a question "per month" is not one
"per year", however close the two words sit in an embedding, while "annual" is "yearly"."""

RELATION_WORDS = frozenset(
    _words("to from into than over for with against versus vs onto in by as per")
)
"""Words that give the two things around them different roles ("from dollars to euros",
"5 km in miles", "10 by 2", "taller than", "butter for oil"): swapping what sits on their two
sides reverses the question."""
