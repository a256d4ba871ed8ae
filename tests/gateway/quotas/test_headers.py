"""Rate-limit headers as OpenAI writes them: resets as Go durations, retry-after in whole
seconds rounded up, and only for the limits that are set."""

from __future__ import annotations

import pytest

from loramux.gateway.quotas.headers import go_duration, retry_after
from tests.gateway.quotas.rig import QuotaRig


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (1, "1ms"),
        (120, "120ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (8640, "8.64s"),
        (17_281, "17.281s"),
        (60_000, "1m0s"),
        (90_024, "1m30.024s"),
        (360_000, "6m0s"),
        (3_600_000, "1h0m0s"),
        (86_400_250, "24h0m0.25s"),
    ],
)
def test_durations_are_written_like_go_and_openai(ms: int, text: str) -> None:
    assert go_duration(ms) == text


@pytest.mark.parametrize(("ms", "seconds"), [(0, "1"), (1, "1"), (1000, "1"), (1001, "2")])
def test_retry_after_is_whole_seconds_rounded_up(ms: int, seconds: str) -> None:
    assert retry_after(ms) == seconds


async def test_headers_name_only_the_limits_that_are_set(rig: QuotaRig) -> None:
    svc = rig.service()
    requests_only = await rig.principal(key={"rpm": 5, "max_concurrent": 3})
    assert (await svc.admit(requests_only, 10, 10)).headers == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "1m0s",
    }
    budget_only = await rig.principal(tenant={"token_budget": 100, "budget_period": "day"})
    assert (await svc.admit(budget_only, 10, 10)).headers == {}


async def test_headers_show_the_binding_scope(rig: QuotaRig) -> None:
    svc = rig.service()
    p = await rig.principal(tenant={"rpm": 100, "tpm": 1000}, key={"rpm": 3, "tpm": 5000})
    headers = (await svc.admit(p, 100, 100)).headers
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "800"
