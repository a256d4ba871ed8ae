"""The semantic cache: paraphrases of a question asked in the same context hit; close but
different questions, other contexts, other tenants and other adapter versions miss."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import pytest

from loramux.cache.embedder import Embedder
from loramux.cache.vectors import F32
from loramux.cache.verifier import parse
from loramux.cache.word_vectors import WordVectors
from tests.cache.conftest import EXACT, SEMANTIC, MakeCache, answer, chat, until_missing

PARAPHRASES = [
    ("How do I reset my password?", "How can I reset my password?"),
    ("What is the capital of France?", "what is the capital of france"),
    (
        "Can I change my delivery address after ordering?",
        "Is it possible to change my delivery address after ordering?",
    ),
]

CLOSE_BUT_DIFFERENT = {
    "another entity": ("What is the population of Tokyo?", "What is the population of Osaka?"),
    "another number": ("Convert 5 kilometers to miles.", "Convert 50 kilometers to miles."),
    "a negation": (
        "My package was delivered, what should I do?",
        "My package was not delivered, what should I do?",
    ),
    "an antonym": ("How do I open a file in Python?", "How do I close a file in Python?"),
    "a reversed relation": ("Convert 10 miles to kilometers.", "Convert 10 kilometers to miles."),
    "an added qualifier": (
        "How long does shipping take?",
        "How long does international shipping take?",
    ),
    "a sign": ("Convert -40 Celsius to Fahrenheit", "Convert 40 Celsius to Fahrenheit"),
    "a comparative": ("Who is older, Alice or Bob?", "Who is younger, Alice or Bob?"),
    "a role": ("How do I kill the parent process?", "How do I kill the child process?"),
    "pronouns": ("What did he say to her?", "What did she say to him?"),
    "a choice": ("Can I take aspirin with ibuprofen?", "Can I take aspirin or ibuprofen?"),
    "a weekday": (
        "What time does the store open on monday?",
        "What time does the store open on tuesday?",
    ),
}
"""The last six were wrong hits (similarity 0.93-0.99, the verifier accepting them) until signs,
comparatives of listed opposites, roles, third-person pronouns, "or" and days were read."""

EXACT_CHARACTERS = {
    "indentation": (
        "What does this Python code print?\nfor i in range(3):\n    print(i)\nprint('done')",
        "What does this Python code print?\nfor i in range(3):\n    print(i)\n    print('done')",
    ),
    "spaces in a string": (
        "How many characters long is the string 'a b'?",
        "How many characters long is the string 'a      b'?",
    ),
    "case in quotes": (
        "Does the word 'Hello' start with a capital letter?",
        "Does the word 'hello' start with a capital letter?",
    ),
    "case of a word": (
        "Does the word Hello start with a capital letter?",
        "Does the word hello start with a capital letter?",
    ),
    "a factorial": ("What is 5!", "What is 5?"),
}
"""Bug: each was a semantic hit (similarity 1.0): whitespace was collapsed, trailing "!" dropped
and case ignored before embedding and verifying, so the two texts compared equal."""


@pytest.mark.parametrize(("stored", "asked"), PARAPHRASES)
async def test_a_paraphrase_hits_with_its_similarity(
    make_cache: MakeCache, stored: str, asked: str
) -> None:
    cache = make_cache()
    await cache.store(chat(stored), SEMANTIC, answer("the answer"))
    hit = await cache.lookup(chat(asked), SEMANTIC)
    assert hit is not None and hit.kind == "semantic"
    assert hit.response.text == "the answer"
    assert hit.similarity is not None and SEMANTIC.threshold <= hit.similarity <= 1.0


@pytest.mark.parametrize("difference", list(CLOSE_BUT_DIFFERENT))
async def test_a_close_but_different_question_misses(
    make_cache: MakeCache, difference: str
) -> None:
    stored, asked = CLOSE_BUT_DIFFERENT[difference]
    cache = make_cache()
    await cache.store(chat(stored), SEMANTIC, answer("the answer"))
    assert await cache.lookup(chat(asked), SEMANTIC) is None


@pytest.mark.parametrize("difference", list(EXACT_CHARACTERS))
async def test_questions_that_differ_in_exact_characters_miss(
    make_cache: MakeCache, difference: str
) -> None:
    stored, asked = EXACT_CHARACTERS[difference]
    cache = make_cache()
    await cache.store(chat(stored), SEMANTIC, answer("the answer"))
    assert await cache.lookup(chat(asked), SEMANTIC) is None
    hit = await cache.lookup(chat(stored), SEMANTIC)  # the same text, character for character
    assert hit is not None and hit.kind == "exact"


async def test_a_quoted_span_asked_the_same_still_hits_semantically(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store(chat("Is 'Hello  World' a valid file name?"), SEMANTIC, answer("yes"))
    hit = await cache.lookup(chat("is  'Hello  World' a valid file name"), SEMANTIC)
    assert hit is not None and hit.kind == "semantic"


async def test_similarity_alone_would_serve_the_reversed_relation(make_cache: MakeCache) -> None:
    """Why the verifier exists: with it off, the reversed conversion is a (wrong) hit."""
    stored, asked = CLOSE_BUT_DIFFERENT["a reversed relation"]
    cache = make_cache()
    await cache.store(chat(stored), SEMANTIC, answer("16.09 km"))
    unverified = dataclasses.replace(SEMANTIC, verifier="off")
    hit = await cache.lookup(chat(asked), unverified)
    assert hit is not None and hit.kind == "semantic"
    assert await cache.lookup(chat(asked), SEMANTIC) is None
    assert cache.stats.verifier_rejections == 1


class WatchedWordVectors(WordVectors):
    """The real word vectors, noting the thread each similarity is computed on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def similarity(self, a: Sequence[str], b: Sequence[str], owner: str = "") -> F32:
        self.threads.append(threading.get_ident())
        return super().similarity(a, b, owner)


async def test_the_verifier_runs_off_the_event_loop(make_cache: MakeCache) -> None:
    """Bug: the verifier ran on the event loop, so one tenant's hits on long questions froze
    the gateway for every tenant. It runs on a thread: the soft alignment it does (a synonym
    here) is computed on a thread other than the loop's."""
    cache = make_cache()
    cache.embedder = Embedder()
    cache.embedder.words = words = WatchedWordVectors()
    await cache.store(chat("How do I modify my delivery address?"), SEMANTIC, answer("the answer"))
    hit = await cache.lookup(chat("How do I change my delivery address?"), SEMANTIC)
    assert hit is not None and hit.kind == "semantic"
    assert words.threads and threading.get_ident() not in words.threads


async def test_a_question_longer_than_the_embedder_reads_is_cached_exactly_only(
    make_cache: MakeCache,
) -> None:
    """Bug: the embedder reads the first 256 word pieces only, so a question that differs from a
    stored one after them scored 1.0 and was served its answer. Such a question is neither
    stored nor looked up semantically (the verifier off, so the embedding alone decides); asked
    again word for word it is an exact hit."""
    unverified = dataclasses.replace(SEMANTIC, verifier="off")
    stored, asked = (
        "#" * 256 + f" How many calories are in an {fruit}?" for fruit in ("apple", "egg")
    )
    cache = make_cache()
    await cache.store(chat(stored), unverified, answer("95 calories"))
    assert await cache.lookup(chat(asked), unverified) is None
    hit = await cache.lookup(chat(stored), unverified)
    assert hit is not None and hit.kind == "exact"


async def test_a_lookup_past_its_embedding_deadline_is_a_counted_miss(
    make_cache: MakeCache,
) -> None:
    """Bug: a lookup waited for its embedding however long the embedder's queue was. Past
    `embed_timeout` it is a plain miss, counted; the embedding still finishes and is
    remembered, so the tenant's next lookup of the question finds it."""
    cache = make_cache(embed_timeout=0.0)
    cache.embedder = Embedder()  # remembers nothing yet
    await cache.store(chat("How do I modify my delivery address?"), SEMANTIC, answer("the answer"))
    asked = chat("How do I change my delivery address?")
    assert await cache.lookup(asked, SEMANTIC) is None
    assert cache.stats.embed_skipped == 1 and cache.stats.errors == 1
    cache.embed_timeout = 60.0
    hit = await cache.lookup(asked, SEMANTIC)
    assert hit is not None and hit.kind == "semantic"


async def test_a_lookup_past_its_deadline_in_the_verifiers_word_lookups_is_a_counted_miss(
    make_cache: MakeCache,
) -> None:
    """Bug: the verifier's word lookups (`Embedder.learn_words`) ran outside `embed_timeout`,
    however long the embedder's queue. The deadline covers the question's embedding and its
    candidates' word lookups: past it, a plain miss, counted. The question's own embedding is
    remembered here, so only the word lookups wait."""
    cache = make_cache(embed_timeout=0.0)
    cache.embedder = Embedder()  # knows no word yet
    await cache.store(chat("How do I modify my delivery address?"), SEMANTIC, answer("the answer"))
    asked = chat("How do I change my delivery address?")
    await cache.embedder.embed(["How do I change my delivery address"], asked.tenant_id)
    assert await cache.lookup(asked, SEMANTIC) is None
    assert cache.stats.embed_skipped == 1 and cache.stats.errors == 1
    cache.embed_timeout = 60.0
    hit = await cache.lookup(asked, SEMANTIC)
    assert hit is not None and hit.kind == "semantic"


async def test_the_same_question_after_another_conversation_misses(make_cache: MakeCache) -> None:
    cache = make_cache()
    about_paris = (("user", "Tell me about Paris."), ("assistant", "Paris is in France."))
    about_rome = (("user", "Tell me about Rome."), ("assistant", "Rome is in Italy."))
    await cache.store(
        chat("How many people live there?", history=about_paris), SEMANTIC, answer("2.1 million")
    )
    assert (
        await cache.lookup(chat("How many people live there?", history=about_rome), SEMANTIC)
        is None
    )
    hit = await cache.lookup(chat("How many people live there ?", history=about_paris), SEMANTIC)
    assert hit is not None and hit.kind == "semantic"


async def test_another_system_prompt_or_parameter_misses(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store(chat("How do I reset my password?"), SEMANTIC, answer("Click reset."))
    terse = (("system", "Answer in one word."),)
    assert await cache.lookup(chat("How can I reset my password?", history=terse), SEMANTIC) is None
    assert await cache.lookup(chat("How can I reset my password?", max_tokens=64), SEMANTIC) is None


async def test_tenant_b_never_gets_tenant_a_entry(make_cache: MakeCache) -> None:
    cache = make_cache()
    question = "How do I reset my password?"
    await cache.store(chat(question, tenant="tenant-a"), SEMANTIC, answer("A's answer"))
    assert await cache.lookup(chat(question, tenant="tenant-b"), SEMANTIC) is None
    assert (
        await cache.lookup(chat("How can I reset my password?", tenant="tenant-b"), SEMANTIC)
        is None
    )
    hit = await cache.lookup(chat("How can I reset my password?", tenant="tenant-a"), SEMANTIC)
    assert hit is not None and hit.response.text == "A's answer"


async def test_a_new_adapter_version_never_gets_the_old_versions_entries(
    make_cache: MakeCache,
) -> None:
    cache = make_cache()
    await cache.store(chat("How do I reset my password?", adapter="1" * 64), SEMANTIC, answer("v1"))
    assert (
        await cache.lookup(chat("How do I reset my password?", adapter="2" * 64), SEMANTIC) is None
    )
    assert (
        await cache.lookup(chat("How can I reset my password?", adapter="2" * 64), SEMANTIC) is None
    )


async def test_entries_stored_without_semantic_are_found_only_exactly(
    make_cache: MakeCache,
) -> None:
    cache = make_cache()
    await cache.store(chat("How do I reset my password?"), EXACT, answer("Click reset."))
    assert await cache.lookup(chat("How can I reset my password?"), SEMANTIC) is None
    hit = await cache.lookup(chat("How do I reset my password?"), SEMANTIC)
    assert hit is not None and hit.kind == "exact"


async def test_text_completions_are_never_semantic(make_cache: MakeCache) -> None:
    cache = make_cache()
    stored = dataclasses.replace(
        chat(""), kind="text", messages=None, prompt="How do I reset my password?"
    )
    await cache.store(stored, SEMANTIC, answer("Click reset."))
    asked = dataclasses.replace(stored, prompt="How can I reset my password?")
    assert await cache.lookup(asked, SEMANTIC) is None


async def test_semantic_entries_expire_after_their_ttl(make_cache: MakeCache) -> None:
    cache = make_cache()
    stored, asked = "How do I reset my password?", "How can I reset my password?"
    # The embedder warm first (its model and these words): cold, the lookup alone took longer
    # than the entry's second, unless an earlier test had warmed it.
    await cache.embedder.embed([stored, asked])
    await cache.embedder.learn_words([*parse(stored).words, *parse(asked).words])
    await cache.store(chat(stored), dataclasses.replace(SEMANTIC, ttl=2), answer("x"))
    assert await cache.lookup(chat(asked), SEMANTIC) is not None
    await until_missing(cache, chat(asked), SEMANTIC)


async def test_a_full_bucket_evicts_the_least_recently_used_entry(make_cache: MakeCache) -> None:
    cache = make_cache(max_entries_per_bucket=3)
    questions = {
        "How do I reset my password?": "How can I reset my password?",
        "What is the capital of France?": "What's the capital of France?",
        "How do I install numpy?": "How can I install numpy?",
        "Who painted the Mona Lisa?": "who painted the mona lisa",
    }
    stored = list(questions)
    for question in stored[:3]:
        await cache.store(chat(question), SEMANTIC, answer(question))
    # Use the first entry, so the second is now the least recently used.
    assert await cache.lookup(chat(questions[stored[0]]), SEMANTIC) is not None
    await cache.store(chat(stored[3]), SEMANTIC, answer(stored[3]))

    evicted = await cache.lookup(chat(questions[stored[1]]), SEMANTIC)
    assert evicted is None
    for question in (stored[0], stored[2], stored[3]):
        hit = await cache.lookup(chat(questions[question]), SEMANTIC)
        assert hit is not None and hit.kind == "semantic" and hit.response.text == question
    bucket = cache.keys.bucket(chat(stored[0]), cache.embedder.model_id)
    assert await cache.redis.zcard(bucket.lru) == 3


async def test_an_entry_stored_by_one_process_is_found_by_another(make_cache: MakeCache) -> None:
    first, second = make_cache(), make_cache()
    await first.store(chat("What is the capital of France?"), SEMANTIC, answer("Paris."))
    assert await second.lookup(chat("What's the capital of France?"), SEMANTIC) is not None
    # `first` now holds a copy of the bucket; an entry `second` adds must still reach it.
    assert await first.lookup(chat("How can I reset my password?"), SEMANTIC) is None
    await second.store(chat("How do I reset my password?"), SEMANTIC, answer("Click reset."))
    hit = await first.lookup(chat("How can I reset my password?"), SEMANTIC)
    assert hit is not None and hit.response.text == "Click reset."


async def test_purge_empties_the_semantic_buckets_too(make_cache: MakeCache) -> None:
    cache = make_cache()
    await cache.store(chat("How do I reset my password?"), SEMANTIC, answer("Click reset."))
    assert await cache.lookup(chat("How can I reset my password?"), SEMANTIC) is not None
    assert await cache.purge("tenant-a", "base") == 1
    assert await cache.lookup(chat("How can I reset my password?"), SEMANTIC) is None
    await cache.store(chat("How do I reset my password?"), SEMANTIC, answer("Click reset."))
    assert await cache.lookup(chat("How can I reset my password?"), SEMANTIC) is not None
