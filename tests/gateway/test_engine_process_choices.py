"""Through the process split, n choices, logprobs and the sampling controls arrive as the
engine makes them: a real `loramux engine` process, spoken to by the gateway's ZeroMQ client,
streams every choice (by index) until the one output that carries the usage, with logprobs and
tokens equal to the same requests run in-process; a refused request fails alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loramux.engine.errors import InvalidRequestError
from loramux.engine.outputs import EngineRequest, RequestOutput
from loramux.engine.sampling import SamplingParams
from loramux.gateway.engine_client.remote import RemoteEngineClient
from tests.engine.conftest import make_engine, run_to_completion
from tests.gateway.engine_process import engine_process

TOKEN = "choices-engine-token"
REQUESTS = [
    EngineRequest(
        "choices",
        SamplingParams(
            max_tokens=6,
            temperature=0.9,
            seed=2**64 + 3,
            n=3,
            logprobs=True,
            top_logprobs=2,
            presence_penalty=-2.0,
            frequency_penalty=-1.0,
            logit_bias=((9, 10.0),),
            ignore_eos=True,
        ),
        prompt_token_ids=list(range(100, 137)),
    ),
    EngineRequest(
        "plain",
        SamplingParams(max_tokens=6, repetition_penalty=0.3, ignore_eos=True),
        prompt_token_ids=list(range(200, 220)),
    ),
]
BAD = EngineRequest(
    "bad", SamplingParams(logit_bias=((2**80, 1.0),)), prompt_token_ids=list(range(5, 9))
)


async def _through_the_channel(url: str) -> tuple[dict[str, list[RequestOutput]], Exception]:
    client = RemoteEngineClient([url], TOKEN)
    await client.start()

    async def one(request: EngineRequest) -> list[RequestOutput]:
        return [out async for out in client.generate(request)]

    try:
        async with asyncio.timeout(120):
            *answers, refused = await asyncio.gather(
                *(one(r) for r in REQUESTS), one(BAD), return_exceptions=True
            )
    finally:
        await client.close()
    assert isinstance(refused, Exception)
    outputs = {r.request_id: a for r, a in zip(REQUESTS, answers, strict=True)}
    return outputs, refused  # type: ignore[return-value]


def test_choices_and_logprobs_cross_the_process_split_unchanged(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    env = {"LORAMUX_MAX_MODEL_LEN": "512", "LORAMUX_MAX_NUM_SEQS": "8"}
    with engine_process(demo_model_dir, tmp_path / "engine", TOKEN, env) as engine:
        remote, refused = asyncio.run(_through_the_channel(engine.url))
    assert isinstance(refused, InvalidRequestError) and "logit_bias" in str(refused)

    local = run_to_completion(make_engine(demo_model_dir), REQUESTS)
    for r in REQUESTS:
        got, expected = remote[r.request_id], local[r.request_id]
        assert [(o.index, o.token_ids, o.finish_reason) for o in got] == [
            (o.index, o.token_ids, o.finish_reason) for o in expected
        ]
        assert got[-1].usage == expected[-1].usage and got[-1].is_last
        assert all(o.usage is None for o in got[:-1]), "the usage ends the stream"
        for g, e in zip(got, expected, strict=True):
            assert (g.logprobs is None) == (e.logprobs is None)
            for a, b in zip(g.logprobs or [], e.logprobs or [], strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert sorted({o.index for o in remote["choices"]}) == [0, 1, 2]
    assert sum(o.finished for o in remote["choices"]) == 3
