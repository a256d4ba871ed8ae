"""How often a semantic hit is right: candidate hit rules on labelled question pairs, as
precision/recall curves over the similarity threshold.

Pairs: `bench/data/paraphrase_pairs.jsonl` (written and frozen before the verifier was redesigned;
see bench/data/README.md), scored on its tuning folds (0–1) and its held-out folds (2–4), and the
older `semantic_pairs.jsonl` as a regression set. Each pair is judged as the cache judges a
lookup of `b` against a stored `a`: the cosine similarity of the two embeddings, then the rule
(a pair either of whose questions is cached exactly only, `keys.exact_only`, never hits).

Rules (candidates):
- `similarity`: the threshold alone;
- `exact words`: the verifier with words matched only to the same word (the earlier design, less
  its word-order check);
- `soft alignment`: the verifier with word vectors (`cache.verifier`, `cache.word_vectors`) —
  what the cache runs;
- `classifier`: logistic regression over alignment features (similarity, substitutions made and
  the weakest one's word similarity, content words) of a looser alignment (word threshold 0.3),
  fitted on the tuning folds only; its curve is over the same similarity thresholds.
An NLI cross-encoder was not measured: no registry package ships one that loads offline.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loramux.cache.embedder import Embedder
from loramux.cache.keys import exact_only, question_text
from loramux.cache.verifier import DEFAULT_WORD_THRESHOLD, Verdict, parse, verify

DATA = Path(__file__).parent / "data"
PAIRS = DATA / "paraphrase_pairs.jsonl"
REGRESSION = DATA / "semantic_pairs.jsonl"
THRESHOLDS = (0.70, 0.75, 0.80, 0.85, 0.88, 0.90, 0.92, 0.94, 0.96)
LOOSE_WORDS = 0.3
TUNING_FOLDS = (0, 1)


@dataclass(frozen=True)
class Pair:
    a: str
    b: str
    same: bool
    kind: str
    domain: str = ""
    fold: int = -1


@dataclass(frozen=True)
class Scored:
    pair: Pair
    similarity: float
    exact: Verdict
    soft: Verdict
    loose: Verdict


def load(path: Path) -> list[Pair]:
    return [Pair(**json.loads(line)) for line in path.read_text().splitlines() if line]


def splits(limit: int | None = None) -> dict[str, list[Pair]]:
    pairs = load(PAIRS)
    out = {
        "tuning": [p for p in pairs if p.fold in TUNING_FOLDS],
        "held_out": [p for p in pairs if p.fold not in TUNING_FOLDS],
        "regression": load(REGRESSION),
    }
    return {name: rows[:limit] for name, rows in out.items()}


async def score(embedder: Embedder, pairs: Sequence[Pair]) -> list[Scored]:
    texts = [question_text(t) for p in pairs for t in (p.a, p.b)]
    vectors = await embedder.embed(texts)
    await embedder.learn_words([w for t in texts for w in parse(t).words])
    similar = embedder.words.similarity
    scored = []
    for n, p in enumerate(pairs):
        a, b = texts[2 * n], texts[2 * n + 1]
        similarity = float(vectors[2 * n] @ vectors[2 * n + 1])
        if exact_only(p.a) or exact_only(p.b):  # the cache never compares them
            refused = Verdict(False, "layout")
            scored.append(Scored(p, similarity, refused, refused, refused))
            continue
        scored.append(
            Scored(
                p,
                similarity,
                verify(b, a),
                verify(b, a, similar, DEFAULT_WORD_THRESHOLD),
                verify(b, a, similar, LOOSE_WORDS),
            )
        )
    return scored


def _features(s: Scored) -> list[float]:
    subs = s.loose.substitutions
    words = len(parse(question_text(s.pair.b)).content)
    return [s.similarity, float(len(subs)), min(subs, default=1.0), float(words)]


def fit_classifier(tuning: Sequence[Scored]) -> Callable[[Scored], bool]:
    """Logistic regression (numpy, L2) on the tuning pairs the loose verifier accepts."""
    rows = [s for s in tuning if s.loose.accepted]
    x = np.array([_features(s) for s in rows])
    y = np.array([s.pair.same for s in rows], dtype=float)
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    w, b = np.zeros(z.shape[1]), 0.0
    for _ in range(3000):
        p = 1 / (1 + np.exp(-(z @ w + b)))
        w -= 0.1 * (z.T @ (p - y) / len(y) + 0.01 * w)
        b -= 0.1 * float((p - y).mean())

    def accepts(s: Scored) -> bool:
        if not s.loose.accepted:
            return False
        logit = float(((np.array(_features(s)) - mean) / std) @ w + b)
        return logit >= 0.0

    return accepts


def curve(scored: Sequence[Scored], rule: Callable[[Scored], bool]) -> list[dict[str, float]]:
    same = np.array([s.pair.same for s in scored])
    sims = np.array([s.similarity for s in scored])
    allowed = np.array([rule(s) for s in scored])
    points = []
    for t in THRESHOLDS:
        hit = allowed & (sims >= t)
        tp, fp = int((hit & same).sum()), int((hit & ~same).sum())
        points.append(
            {
                "threshold": t,
                "precision": tp / (tp + fp) if tp + fp else 1.0,
                "recall": tp / int(same.sum()) if same.any() else 0.0,
                "false_hits": fp,
            }
        )
    return points


def by_kind(scored: Sequence[Scored], threshold: float) -> dict[str, dict[str, Any]]:
    """Per kind of pair, with soft alignment at `threshold`: how many hit, and what refused."""
    out: dict[str, dict[str, Any]] = {}
    for s in scored:
        row = out.setdefault(s.pair.kind, {"pairs": 0, "hits": 0, "refused_by": {}})
        row["pairs"] += 1
        reason = "similarity" if s.similarity < threshold else s.soft.reason
        if reason == "ok":
            row["hits"] += 1
        else:
            row["refused_by"][reason] = row["refused_by"].get(reason, 0) + 1
    return out


async def decision_quality(limit: int | None = None) -> dict[str, Any]:
    embedder = Embedder()
    scored = {name: await score(embedder, pairs) for name, pairs in splits(limit).items()}
    classifier = fit_classifier(scored["tuning"])
    rules: dict[str, Callable[[Scored], bool]] = {
        "similarity": lambda s: True,
        "exact words": lambda s: s.exact.accepted,
        "soft alignment": lambda s: s.soft.accepted,
        "classifier": classifier,
    }
    return {
        "curves": {
            rule: {name: curve(rows, accepts) for name, rows in scored.items()}
            for rule, accepts in rules.items()
        },
        "by_kind_held_out_at_0.90": by_kind(scored["held_out"], 0.90),
        "pairs": {
            name: {"total": len(rows), "paraphrases": sum(s.pair.same for s in rows)}
            for name, rows in scored.items()
        },
    }


def point(quality: dict[str, Any], rule: str, split: str, threshold: float) -> dict[str, float]:
    found: dict[str, float] = next(
        p for p in quality["curves"][rule][split] if p["threshold"] == threshold
    )
    return found


def print_curves(quality: dict[str, Any]) -> None:
    for split in ("held_out", "tuning", "regression"):
        n = quality["pairs"][split]
        print(f"\n{split} ({n['total']} pairs, {n['paraphrases']} paraphrases): precision / recall")
        print(f"{'rule':<16}" + "".join(f"{t:>13.2f}" for t in THRESHOLDS))
        for rule, splits_ in quality["curves"].items():
            cells = "".join(f"{p['precision']:>7.3f}/{p['recall']:.2f}" for p in splits_[split])
            print(f"{rule:<16}{cells}")
