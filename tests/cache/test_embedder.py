"""The embedder: all-MiniLM-L6-v2 from the shipped package, unit vectors, one model per process,
concurrent requests batched together, each tenant's texts remembered for it alone."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import pytest

from loramux.cache.embedder import Backlogged, Embedder, default_model_path, load_model
from loramux.cache.keys import question_text
from loramux.cache.word_vectors import WordVectors
from tests.cache.conftest import SEMANTIC, MakeCache, answer, chat


async def test_embeddings_are_unit_float32_rows(embedder: Embedder) -> None:
    vectors = await embedder.embed(
        ["How do I reset my password?", "What is the capital of France?"]
    )
    assert vectors.shape == (2, embedder.dim) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert float(vectors[0] @ vectors[1]) < 0.5


async def test_paraphrases_are_closer_than_other_questions(embedder: Embedder) -> None:
    a, b, c = await embedder.embed(
        ["How do I reset my password?", "How can I reset my password?", "How do I bake bread?"]
    )
    assert float(a @ b) > 0.9 > float(a @ c)


async def test_concurrent_requests_get_the_same_vectors_as_one_batch(embedder: Embedder) -> None:
    texts = [f"Question number {i} about shipping" for i in range(12)]
    together = await embedder.embed(texts)
    fresh = Embedder()
    one_by_one = await asyncio.gather(*(fresh.embed([t]) for t in texts))
    assert np.allclose(np.concatenate(one_by_one), together, atol=1e-5)


async def test_no_texts_give_an_empty_matrix(embedder: Embedder) -> None:
    assert (await embedder.embed([])).shape == (0, embedder.dim)


def test_the_model_is_loaded_once_per_process() -> None:
    assert load_model(default_model_path()) is load_model(default_model_path())


async def test_a_text_longer_than_the_models_window_is_not_embedded_whole(
    embedder: Embedder,
) -> None:
    """Bug: the model reads only its first 256 word pieces (special tokens included), so two
    questions that differ after them embed alike, and 1000 characters of "#" fill the window.
    Such a text has no whole embedding; one that fits has."""
    tail_apart = ["#" * 256 + " apples", "#" * 256 + " oranges"]
    vectors = await embedder.embed(tail_apart)
    assert float(vectors[0] @ vectors[1]) > 0.9999  # why: the tails are never read
    assert [await embedder.embed_whole(t) for t in tail_apart] == [None, None]
    assert await embedder.embed_whole("#" * 255) is None
    fits = await embedder.embed_whole("#" * 254)  # + [CLS] and [SEP]: 256 pieces
    assert fits is not None and fits.shape == (embedder.dim,)


class EncodedTexts:
    """The texts the shared sentence-transformers model is asked to encode (a spy on the
    third-party model; the embedder and the cache are the real ones)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.texts: list[str] = []
        model = load_model(default_model_path())
        encode = model.encode

        def spy(texts: list[str], *args: Any, **kwargs: Any) -> Any:
            self.texts.extend(texts)
            return encode(texts, *args, **kwargs)

        monkeypatch.setattr(model, "encode", spy)


async def test_no_tenant_is_served_another_tenants_remembered_embedding(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: one memo of recent texts (and of the verifier's words) served every tenant, so a
    tenant's miss came back faster when another tenant had asked the same question moments
    before: its latency told it what others ask. Each tenant's lookup now encodes its own."""
    cache = make_cache()
    question = f"What is the refund policy for order {uuid.uuid4().hex[:8]}?"
    await cache.store(chat(question, tenant="tenant-a"), SEMANTIC, answer("30 days"))
    encoded = EncodedTexts(monkeypatch)
    for tenant in ("tenant-b", "tenant-c", "tenant-b"):  # B's second lookup: B's own memo
        assert await cache.lookup(chat(question, tenant=tenant), SEMANTIC) is None
    assert encoded.texts.count(question_text(question)) == 2


async def test_tenants_asking_the_same_text_at_once_are_not_coalesced(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: a text in flight for one tenant was handed to another asking it at the same time
    (one encoding, both waiting on it): the second's lookup ended with the first's. Each tenant's
    text is encoded for it; one tenant's repeats still share one encoding."""
    cache = make_cache()
    question = f"How do I change the address of order {uuid.uuid4().hex[:8]}?"
    encoded = EncodedTexts(monkeypatch)
    asks = [chat(question, tenant=t) for t in ("tenant-a", "tenant-b", "tenant-a")]
    await asyncio.gather(*(cache.lookup(req, SEMANTIC) for req in asks))
    assert encoded.texts.count(question_text(question)) == 2


def test_the_verifiers_word_memo_is_kept_per_tenant() -> None:
    """Bug: the verifier's word vectors were remembered for every tenant at once (a smaller
    channel of the same kind); a word one tenant used is unknown to another until it uses it."""
    words = WordVectors()
    word = f"zq{uuid.uuid4().hex[:6]}"
    words.learn([word, "refund"], "tenant-a")
    assert words.unknown([word, "refund"], "tenant-a") == []
    assert words.unknown([word, "refund"], "tenant-b") == [word, "refund"]


async def test_tenants_are_embedded_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: one first-come-first-served queue, so a tenant's lookup waited for every text other
    tenants had sent before it (96 long questions: tens of seconds). Batches now take the
    tenants' waiting texts in turn: B's one question goes into the first batch, ahead of A's
    remaining queue."""
    embedder = Embedder(max_batch=4)
    batches: list[list[str]] = []
    model = load_model(default_model_path())
    encode = model.encode

    def spy(texts: list[str], *args: Any, **kwargs: Any) -> Any:
        batches.append(list(texts))
        return encode(texts, *args, **kwargs)

    monkeypatch.setattr(model, "encode", spy)
    tag = uuid.uuid4().hex[:8]
    flood = [embedder.encode([f"{tag} long report number {i}"], "tenant-a") for i in range(12)]
    asked = embedder.encode([f"{tag} what is 2 plus 2"], "tenant-b")
    await asyncio.gather(*flood, asked)
    assert [len(b) for b in batches] == [4, 4, 4, 1]
    assert f"{tag} what is 2 plus 2" in batches[0]
    assert batches[0][0] == f"{tag} long report number 0"  # each tenant's in arrival order


async def test_a_tenant_with_too_many_texts_waiting_is_refused_more() -> None:
    """Each tenant may have `max_waiting` texts waiting; more are refused at once (the cache's
    lookup is then a miss), and other tenants are not."""
    embedder = Embedder(max_waiting=3)
    tag = uuid.uuid4().hex[:8]
    asks = [embedder.encode([f"{tag} report {i}"], "tenant-a") for i in range(4)]
    asks += [embedder.encode([f"{tag} report 0"], "tenant-a")]  # waiting already: shares it
    asks += [embedder.encode([f"{tag} report 0"], "tenant-b")]
    outcomes = await asyncio.gather(*asks, return_exceptions=True)
    assert [isinstance(o, Backlogged) for o in outcomes] == [False] * 3 + [True, False, False]
    await embedder.encode([f"{tag} report 3"], "tenant-a")  # none waiting any more


async def test_word_lookups_take_their_turn_and_count_towards_the_bound() -> None:
    """Bug: the verifier's word lookups (`learn_words`) went straight to the one worker, first
    come first served and uncapped: tenant A's 16 lookups of 64 words all ran before tenant B's
    one question. They are texts of their tenant now: B's question is in the first batch, and
    A's lookups past `max_waiting` are refused (the cache's lookup is then a plain miss)."""
    embedder = Embedder(max_waiting=2)
    tag = uuid.uuid4().hex[:6]
    done: list[str] = []

    async def learn(n: int) -> None:
        await embedder.learn_words([f"zq{tag}w{n}x{i}" for i in range(64)], "tenant-a")
        done.append(f"a{n}")

    async def ask() -> None:
        await embedder.encode([f"{tag} how do I reset my password"], "tenant-b")
        done.append("b")

    outcomes = await asyncio.gather(*(learn(n) for n in range(16)), ask(), return_exceptions=True)
    assert done == ["b", "a0"]
    assert [isinstance(o, Backlogged) for o in outcomes] == [False] + [True] * 15 + [False]
    assert embedder.words.unknown([f"zq{tag}w0x{i}" for i in range(64)], "tenant-a") == []
    assert len(embedder.words.unknown([f"zq{tag}w1x0"], "tenant-a")) == 1
