"""What a request may do with the response cache, from tenant settings, Cache-Control and the
body's `cache` extension; and the cache's identity of an engine request."""

from __future__ import annotations

from typing import Any

import pytest

from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.gateway.cache_policy import DEFAULTS, cache_policy, cache_request, is_deterministic
from loramux.gateway.errors import BadRequest

SEMANTIC_TENANT: dict[str, Any] = {"cache": {"semantic": True, "threshold": 0.95, "ttl": 60}}


def test_defaults_cache_deterministic_requests_exactly_for_an_hour() -> None:
    policy = cache_policy({}, None, None, deterministic=True)
    assert (policy.lookup, policy.store, policy.semantic) == (True, True, False)
    assert (policy.ttl, policy.threshold, policy.verifier) == (3600, 0.90, "strict")
    assert DEFAULTS["enabled"] and not DEFAULTS["cache_sampled"]


def test_sampled_requests_are_not_cached_unless_the_tenant_says_so() -> None:
    assert not cache_policy({}, None, None, deterministic=False).lookup
    assert not cache_policy({}, None, None, deterministic=False).store
    sampled = cache_policy({"cache": {"cache_sampled": True, "semantic": True}}, None, None, False)
    assert sampled.lookup and sampled.store and not sampled.semantic


def test_a_tenant_can_turn_the_cache_off() -> None:
    policy = cache_policy({"cache": {"enabled": False}}, None, None, deterministic=True)
    assert not policy.lookup and not policy.store


@pytest.mark.parametrize(
    ("header", "lookup", "store"),
    [
        ("no-cache", False, True),
        ("no-store", False, False),
        ("No-Cache, max-age=0", False, True),
        ("max-age=0", True, True),
    ],
)
def test_cache_control(header: str, lookup: bool, store: bool) -> None:
    policy = cache_policy(SEMANTIC_TENANT, header, None, deterministic=True)
    assert (policy.lookup, policy.store) == (lookup, store)


def test_semantic_needs_the_tenant_and_not_a_refusal_in_the_body() -> None:
    assert not cache_policy({}, None, {"semantic": True}, True).semantic
    assert cache_policy(SEMANTIC_TENANT, None, None, True).semantic
    assert cache_policy(SEMANTIC_TENANT, None, {"semantic": None}, True).semantic
    assert not cache_policy(SEMANTIC_TENANT, None, {"semantic": False}, True).semantic


def test_the_body_ttl_overrides_the_tenant_ttl_within_bounds() -> None:
    assert cache_policy(SEMANTIC_TENANT, None, None, True).ttl == 60
    assert cache_policy(SEMANTIC_TENANT, None, {"ttl": 5}, True).ttl == 5
    for bad in (0, -1, 10**9, True, "60"):
        with pytest.raises(BadRequest):
            cache_policy(SEMANTIC_TENANT, None, {"ttl": bad}, True)


def test_determinism_is_temperature_zero_or_a_seed() -> None:
    assert is_deterministic(SamplingParams(temperature=0.0))
    assert is_deterministic(SamplingParams(temperature=0.8, seed=3))
    assert not is_deterministic(SamplingParams(temperature=0.8))


def _request(**params: Any) -> EngineRequest:
    messages = [{"role": "user", "content": "Hi"}]
    return EngineRequest("r1", SamplingParams(**params), messages=messages, adapter="d" * 64)


def test_greedy_requests_ignore_the_sampling_knobs_greedy_decoding_ignores() -> None:
    a = cache_request("t", "m", _request(temperature=0.0, top_p=0.5, seed=1))
    b = cache_request("t", "m", _request(temperature=0.0, top_k=3))
    assert a == b
    assert cache_request("t", "m", _request(temperature=0.7, seed=1)) != cache_request(
        "t", "m", _request(temperature=0.7, seed=2)
    )


def test_the_cache_request_carries_tenant_adapter_messages_and_params() -> None:
    req = cache_request("t", "m", _request(max_tokens=9, stop=("x",)), {"type": "json_object"})
    assert (req.tenant_id, req.base_model, req.adapter, req.kind) == ("t", "m", "d" * 64, "chat")
    assert req.messages == (("user", "Hi"),) and req.prompt is None
    assert hash(req) == hash(
        cache_request("t", "m", _request(max_tokens=9, stop=("x",)), {"type": "json_object"})
    )
    params = dict(req.params)
    assert params["max_tokens"] == 9 and params["stop"] == ("x",)
    assert params["response_format"] == '{"type":"json_object"}'
    text = cache_request("t", "m", EngineRequest("r2", SamplingParams(), prompt_token_ids=[1, 2]))
    assert (text.kind, text.prompt, text.adapter) == ("text", (1, 2), "base")


def test_a_message_name_is_part_of_the_key() -> None:
    """A template that writes names makes them part of the prompt: two speakers asking the same
    are two requests (the bug: the key held (role, content) pairs alone)."""

    def asked_by(name: str | None) -> EngineRequest:
        message: dict[str, Any] = {"role": "user", "content": "Who am I?"}
        message |= {"name": name} if name is not None else {}
        return EngineRequest("r", SamplingParams(), messages=[message])

    keys = {cache_request("t", "m", asked_by(name)) for name in ("Alice", "Bob", None)}
    assert len(keys) == 3
    assert cache_request("t", "m", asked_by("Alice")) == cache_request("t", "m", asked_by("Alice"))
