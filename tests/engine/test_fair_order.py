"""New requests are queued round-robin by owner (Scheduler.add), so one owner's queued requests
cannot hold another's back: on the demo model, one request at a time, the admission order is
the fair one, a preempted request still goes first, and one owner alone keeps arrival order;
each request's tokens are what they are in arrival order."""

from __future__ import annotations

from pathlib import Path

from loramux.engine.llm_engine import LLMEngine
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from tests.engine.conftest import make_engine


def _request(request_id: str, owner: str | None, max_tokens: int = 2) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [3 + ord(c) % 50 for c in request_id] * 4
    return EngineRequest(request_id, params, prompt_token_ids=prompt, owner=owner)


def _run(
    engine: LLMEngine, requests: list[EngineRequest]
) -> tuple[list[str], dict[str, list[int]]]:
    """Queue `requests` in order, step until idle: the request ids in the order of their first
    outputs, and each request's tokens."""
    for r in requests:
        engine.add_request(r)
    order: list[str] = []
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_work:
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
            tokens[out.request_id].extend(out.token_ids)
    return order, tokens


def _one_at_a_time(demo_model_dir: Path) -> LLMEngine:
    return make_engine(demo_model_dir, max_num_seqs=1)


def test_another_owner_s_request_goes_second_not_behind_the_flood(demo_model_dir: Path) -> None:
    flood = [_request(f"a{i}", "tnt_a") for i in range(6)]
    order, _ = _run(_one_at_a_time(demo_model_dir), [*flood, _request("b0", "tnt_b")])
    assert order == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]


def test_three_owners_interleave_round_robin_with_their_arrival_order_tokens(
    demo_model_dir: Path,
) -> None:
    requests = [_request(f"{o}{i}", f"tnt_{o}") for o in "abc" for i in range(3)]
    order, tokens = _run(_one_at_a_time(demo_model_dir), requests)
    assert order == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    unowned = [_request(r.request_id, None) for r in requests]
    arrival_order, arrival_tokens = _run(_one_at_a_time(demo_model_dir), unowned)
    assert arrival_order == [r.request_id for r in requests]
    assert tokens == arrival_tokens and all(len(t) == 2 for t in tokens.values())


def test_one_owner_alone_keeps_arrival_order(demo_model_dir: Path) -> None:
    for owner in ("tnt_a", None):
        requests = [_request(f"r{i}", owner) for i in range(5)]
        order, _ = _run(_one_at_a_time(demo_model_dir), requests)
        assert order == [f"r{i}" for i in range(5)], owner


def test_a_preempted_request_still_goes_first(demo_model_dir: Path) -> None:
    # 4 blocks of 16: a0 and a1 (16-token prompts) run until both need a third block.
    engine = make_engine(demo_model_dir, max_num_seqs=2, num_kv_blocks=4, max_model_len=64)
    flood = [_request(f"a{i}", "tnt_a", max_tokens=40) for i in range(4)]
    for r in flood:
        engine.add_request(r)
    steps: list[set[str]] = []
    while not engine.stats().preemptions:
        steps.append({out.request_id for out in engine.step()})
    assert [s.request_id for s in engine.scheduler.waiting] == ["a1", "a2", "a3"]
    engine.add_request(_request("b0", "tnt_b", max_tokens=40))
    # a1 was computed: it keeps the head; b0 ranks among the never-computed a2 and a3.
    assert [s.request_id for s in engine.scheduler.waiting] == ["a1", "a2", "b0", "a3"]
    preempted_at = len(steps)
    while engine.has_work:
        steps.append({out.request_id for out in engine.step()})
    later = steps[preempted_at:]
    first = {r: next(i for i, s in enumerate(later) if r in s) for r in ("a1", "a2", "b0", "a3")}
    assert first["a1"] < first["b0"] and first["a2"] <= first["b0"] < first["a3"]
    assert engine.stats().kv_blocks_used == 0
