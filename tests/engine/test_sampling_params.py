"""The sampling controls' parameters: every value a hostile request can send is refused with an
InvalidRequestError naming the field, in a short message; good values are kept as given."""

from __future__ import annotations

import pytest

from loramux.engine.errors import InvalidRequestError
from loramux.engine.sampling import SamplingParams, choice_seed

HUGE = 10**400


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        *[
            ({name: value}, name)
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
            for value in (float("nan"), float("inf"), -float("inf"), HUGE, -HUGE, True, "1", None)
        ],
        ({"presence_penalty": 2.0001}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((5, HUGE),)}, "logit_bias"),
        ({"logit_bias": ((True, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5.0, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((5, 1.0, 2.0),)}, "logit_bias"),
        ({"logit_bias": ((5,),)}, "logit_bias"),
        ({"logit_bias": "5:1"}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"logit_bias": ((7, 100.0), (7, 100.0))}, "logit_bias"),  # would add up to 200
        ({"logit_bias": ((7, 100.0), (3, 1.0), (7, -100.0))}, "logit_bias"),  # would cancel
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": "true"}, "logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2**70, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": True, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 2**64 + 1}, "n"),
        ({"n": -(10**5000)}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
    ],
)
def test_hostile_values_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    message = str(refused.value)
    assert message.startswith(field) and len(message) < 200


def test_the_edges_of_each_range_are_accepted() -> None:
    params = SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2,
        repetition_penalty=1e300,
        min_p=1.0,
        logit_bias=tuple((i, 100.0 if i % 2 else -100) for i in range(300)),
        logprobs=True,
        top_logprobs=20,
        n=16,
    )
    assert params.penalizes and params.n == 16
    assert not SamplingParams().penalizes


def test_choice_seeds_differ_per_choice_and_keep_the_request_seed_for_choice_zero() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(5, 0) == 5
    seeds = {choice_seed(5, i) for i in range(1, 16)}
    assert len(seeds) == 15 and all(0 <= s < 2**64 for s in seeds if s is not None)
    assert choice_seed(-1, 2) == choice_seed(2**64 - 1, 2), "the seed is taken mod 2^64"
