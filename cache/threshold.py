"""A tenant's similarity threshold chosen from its own labelled pairs, as RedisVL's
`CacheThresholdOptimizer` does: score every pair as the cache would (similarity of the two
questions, and the verifier's verdict), then take the threshold that does best on them.

Objectives: `f1` (the F1 score of hits against the labels) or `precision` (the most recall whose
precision is at least `min_precision`). Candidate thresholds are the pairs' own similarities
(clamped to the range a tenant may set); ties go to the higher threshold, the safer side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from loramux.cache.embedder import Embedder
from loramux.cache.keys import exact_only, question_text
from loramux.cache.verifier import parse, verify

Objective = Literal["f1", "precision"]
LOWEST, HIGHEST = 0.5, 1.0
"""The thresholds a tenant may set (`gateway.cache.schemas.Threshold`)."""


@dataclass(frozen=True)
class ScoredPair:
    similarity: float
    verified: bool
    """The verifier accepted the pair."""
    same: bool
    """The label: the cached answer to one question answers the other."""


@dataclass(frozen=True)
class ThresholdChoice:
    threshold: float
    precision: float
    recall: float
    f1: float


def outcome(pairs: Sequence[ScoredPair], threshold: float) -> ThresholdChoice:
    """Precision, recall and F1 of serving a hit for each pair at or above `threshold` that the
    verifier accepts (precision is 1.0 when nothing is served)."""
    served = [p for p in pairs if p.verified and p.similarity >= threshold]
    right = sum(p.same for p in served)
    positives = sum(p.same for p in pairs)
    precision = right / len(served) if served else 1.0
    recall = right / positives if positives else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return ThresholdChoice(threshold, precision, recall, f1)


def choose_threshold(
    pairs: Sequence[ScoredPair], objective: Objective, min_precision: float = 0.98
) -> ThresholdChoice | None:
    """The best threshold for `objective`; None when no threshold meets `min_precision` with any
    recall (or no pair is labelled the same)."""
    if not any(p.same for p in pairs):
        return None
    candidates = {min(max(p.similarity, LOWEST), HIGHEST) for p in pairs} | {LOWEST, HIGHEST}
    results = [outcome(pairs, t) for t in sorted(candidates, reverse=True)]
    if objective == "precision":
        results = [r for r in results if r.precision >= min_precision and r.recall > 0]
    if not results:
        return None
    key = (lambda r: r.f1) if objective == "f1" else (lambda r: r.recall)
    return max(results, key=key)  # max keeps the first of equals: the highest threshold


async def score_pairs(
    embedder: Embedder, pairs: Sequence[tuple[str, str, bool]]
) -> list[ScoredPair]:
    """Each (cached question, asked question, same) as the cache would judge it: the cosine
    similarity of their embeddings and the verifier's verdict (with word vectors); a pair with a
    question longer than the embedder reads, or cached exactly only, is never verified. Texts and
    words are embedded a batch at a time, in turn with the tenants' lookups."""
    texts = [question_text(t) for a, b, _ in pairs for t in (a, b)]
    # A chunk at a time, each waiting its turn (`Embedder`): thousands of texts and words never
    # hold the embedder's one worker from the tenants' lookups, nor fill this owner's queue.
    step = embedder.max_batch
    encodings = []
    for start in range(0, len(texts), step):
        encodings += await embedder.encode(texts[start : start + step])
    words = list(dict.fromkeys(w for t in texts for w in parse(t).words))
    for start in range(0, len(words), step):
        await embedder.learn_words(words[start : start + step])

    def judge() -> list[ScoredPair]:
        scored = []
        for n, (_, _, same) in enumerate(pairs):
            a, b = texts[2 * n], texts[2 * n + 1]
            ea, eb = encodings[2 * n], encodings[2 * n + 1]
            similarity = float(ea.vector @ eb.vector)
            # A question longer than the embedder reads never hits (`ResponseCache`).
            whole = ea.whole and eb.whole
            # Nor does one the cache keeps exact only (`keys.exact_only`).
            semantic = not (exact_only(pairs[n][0]) or exact_only(pairs[n][1]))
            verdict = verify(b, a, embedder.words.similarity)
            scored.append(ScoredPair(similarity, whole and semantic and verdict.accepted, same))
        return scored

    # Up to thousands of verdicts: on a thread, as the cache's own, so the loop serves on.
    return await asyncio.to_thread(judge)
