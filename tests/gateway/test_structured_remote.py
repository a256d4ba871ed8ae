"""Structured outputs through the process split: a real `loramux engine` process, spoken to by
the gateway's ZeroMQ client, serves schema-valid JSON and refuses an uncompilable schema with
its own error class before anything is queued, and a grammar that fails mid-generation with its
own class too; the gateway answers those errors with 400s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from loramux.engine.errors import StructuredOutputFailedError
from loramux.engine.outputs import EngineRequest
from loramux.engine.sampling import SamplingParams
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.gateway.engine_client.remote import RemoteEngineClient
from loramux.gateway.errors import to_gateway_error
from tests.engine.structured_schemas import FAILS_MID_RUN, NESTED, schema_text
from tests.gateway.engine_process import engine_process

TOKEN = "structured-engine-token"


async def _through_the_channel(url: str) -> list[int]:
    """The token ids of a constrained output (its EOS left off), after a refused request."""
    client = RemoteEngineClient([url], TOKEN)
    await client.start()
    try:
        [before] = await client.stats()
        bad = StructuredOutput("json_schema", '{"type": "string", "pattern": "("}')
        refused = EngineRequest("bad", SamplingParams(structured=bad), prompt_token_ids=[5, 6, 7])
        with pytest.raises(StructuredOutputError, match="cannot be compiled"):
            await anext(client.generate(refused))
        [after] = await client.stats()
        assert (after.waiting, after.running, after.steps) == (
            before.waiting,
            before.running,
            before.steps,
        )

        failing = StructuredOutput("json_schema", schema_text(FAILS_MID_RUN))
        mid_run = EngineRequest(
            "mid-run", SamplingParams(max_tokens=20, structured=failing), prompt_token_ids=[5, 6]
        )
        with pytest.raises(StructuredOutputFailedError, match="bytes of output in a row"):
            async with asyncio.timeout(120):
                _ = [out async for out in client.generate(mid_run)]

        good = StructuredOutput("json_schema", schema_text(NESTED))
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=good)
        request = EngineRequest("good", params, prompt_token_ids=[5, 6, 7])
        async with asyncio.timeout(120):
            outputs = [out async for out in client.generate(request)]
        assert outputs[-1].finish_reason == "stop"
        return [t for o in outputs for t in o.token_ids][:-1]
    finally:
        await client.close()


def test_the_engine_process_serves_valid_json_and_refuses_a_bad_schema_before_queueing(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    with engine_process(demo_model_dir, tmp_path / "engine", TOKEN, {}) as engine:
        ids = asyncio.run(_through_the_channel(engine.url))
    text = AutoTokenizer.from_pretrained(demo_model_dir).decode(ids)
    jsonschema.validate(json.loads(text), NESTED)


def test_a_structured_output_error_is_a_400_on_response_format() -> None:
    error = to_gateway_error(StructuredOutputError("the JSON schema is not valid JSON"))
    assert error is not None
    assert (error.status, error.param, error.code) == (400, "response_format", "invalid_request")


def test_a_structured_output_failing_mid_generation_is_a_400_for_the_client() -> None:
    """The request's own schema failed it after admission: an invalid_request_error naming the
    structured output, not a 500 `request_failed` (the engine's fault)."""
    error = to_gateway_error(StructuredOutputFailedError("the grammar could not follow"))
    assert error is not None
    assert (error.status, error.code) == (400, "structured_output_failed")
    assert error.body()["error"]["type"] == "invalid_request_error"
