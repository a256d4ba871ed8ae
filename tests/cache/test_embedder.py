"""The embedder: all-MiniLM-L6-v2 from the shipped package, unit vectors, one model per process,
concurrent requests batched together."""

from __future__ import annotations

import asyncio

import numpy as np

from loramux.cache.embedder import Embedder, default_model_path, load_model


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
