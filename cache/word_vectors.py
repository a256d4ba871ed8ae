"""Word vectors for the verifier's soft alignment, from the embedder's own model.

A content word of one question may meet a different word of the other ("annual" / "yearly").
How close two words are is read from all-MiniLM-L6-v2 itself: each word is encoded alone as a
sentence (mean-pooled, normalized), once per owner (tenant) and process and remembered, so the
vocabulary a tenant uses is encoded once. Words are remembered per owner: a word another tenant
used is encoded anew, so how long a tenant's verification takes says nothing of other tenants'
words. Single-word sentence vectors separate synonyms from unrelated words far
better than the model's input token table does (see `bench.response_cache`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loramux.cache.vectors import F32


class WordVectors:
    """Unit vectors of single words, remembered (least recently used dropped past `remember`).

    Thread-safe; `similarity` blocks while unknown words are encoded, so the response cache
    calls `learn` for a question's words off the event loop before it verifies."""

    def __init__(self, model_path: Path | None = None, *, remember: int = 50_000):
        self.model_path = model_path
        self.remember = remember
        self._known: OrderedDict[tuple[str, str], F32] = OrderedDict()
        """(owner, word) -> its vector, least recently used first."""
        self._lock = threading.Lock()

    def unknown(self, words: Sequence[str], owner: str = "") -> list[str]:
        """The words of `words` not known for `owner`, once each."""
        with self._lock:
            return [w for w in dict.fromkeys(words) if (owner, w) not in self._known]

    def learn(self, words: Sequence[str], owner: str = "") -> dict[str, F32]:
        """The vectors of `words`, encoding those not yet known for `owner` (blocking: run it on
        a worker thread when any may be unknown)."""
        with self._lock:
            found = {w: self._known[owner, w] for w in words if (owner, w) in self._known}
            for word in found:
                self._known.move_to_end((owner, word))
        missing = [w for w in dict.fromkeys(words) if w not in found]
        if not missing:
            return found
        from loramux.cache.embedder import default_model_path, load_model

        model = load_model(self.model_path or default_model_path())
        vectors = model.encode(
            missing,
            batch_size=len(missing),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        fresh = dict(zip(missing, np.asarray(vectors, dtype=np.float32), strict=True))
        self.add(fresh, owner)
        return found | fresh

    def add(self, vectors: dict[str, F32], owner: str = "") -> None:
        """Remember `vectors` (word -> its unit vector, encoded elsewhere) for `owner`."""
        with self._lock:
            self._known.update({(owner, w): v for w, v in vectors.items()})
            while len(self._known) > self.remember:
                self._known.popitem(last=False)

    def similarity(self, a: Sequence[str], b: Sequence[str], owner: str = "") -> F32:
        """len(a) × len(b) cosine similarities (`verifier.WordSimilarity`), with `owner`'s
        memo."""
        known = self.learn([*a, *b], owner)
        left = np.stack([known[w] for w in a])
        right = np.stack([known[w] for w in b])
        return np.asarray(left @ right.T, dtype=np.float32)
