"""A tenant's threshold is chosen from its own labelled pairs: the best F1, or the most recall at
a precision floor, ties to the higher (safer) threshold."""

from __future__ import annotations

from loramux.cache.threshold import ScoredPair, choose_threshold, outcome

PAIRS = [
    ScoredPair(0.97, True, True),
    ScoredPair(0.93, True, True),
    ScoredPair(0.91, True, False),
    ScoredPair(0.88, True, True),
    ScoredPair(0.86, False, False),  # the verifier refuses it at any threshold
    ScoredPair(0.70, True, False),
]


def test_precision_objective_takes_the_most_recall_at_the_floor() -> None:
    choice = choose_threshold(PAIRS, "precision", min_precision=1.0)
    assert choice is not None
    assert (choice.threshold, choice.precision, choice.recall) == (0.93, 1.0, 2 / 3)


def test_f1_objective_may_accept_a_wrong_hit_for_recall() -> None:
    choice = choose_threshold(PAIRS, "f1")
    assert choice is not None and choice.threshold == 0.88
    assert choice.recall == 1.0 and choice.precision == 0.75


def test_no_qualifying_threshold_is_none() -> None:
    wrong_only = [ScoredPair(0.99, True, False), ScoredPair(0.95, True, True)]
    assert choose_threshold(wrong_only, "precision", min_precision=0.99) is None
    assert choose_threshold([ScoredPair(0.9, True, False)], "f1") is None


def test_thresholds_stay_in_the_range_a_tenant_may_set() -> None:
    low = [ScoredPair(0.2, True, True), ScoredPair(0.1, True, False)]
    assert choose_threshold(low, "precision", min_precision=1.0) is None
    choice = choose_threshold([*low, ScoredPair(1.3, True, True)], "precision")
    assert choice is not None and choice.threshold == 1.0


def test_serving_nothing_has_precision_one_and_no_recall() -> None:
    nothing = outcome(PAIRS, 0.99)
    assert (nothing.precision, nothing.recall, nothing.f1) == (1.0, 0.0, 0.0)
