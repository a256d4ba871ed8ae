"""A request's sampling parameters, as the engine takes them.

The body's types already bound every number (`gateway.openai.schemas`); the rules here span
fields or need the model: at most 4 stop strings, top_logprobs only with logprobs, logit_bias
keys that are token ids of this model's vocabulary, and `response_format` as the engine's
`StructuredOutput`. Each refusal names its `param`.
"""

from __future__ import annotations

import json

from loramux.engine.sampling import SamplingParams
from loramux.engine.structured import StructuredOutput, StructuredOutputError
from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ResponseFormat,
)

MAX_STOP = 4
MAX_STOP_CHARS = 1000
"""Longest stop string: matching tables are built on the event loop (once per string, shared by
a request's choices), in time proportional to its length."""


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    vocab_size: int,
    forced_call: str | None = None,
) -> SamplingParams:
    """The engine's parameters; `forced_call` is the JSON schema a forced tool call
    (`tool_choice` required or named) holds the output to."""
    logprobs, top_logprobs = _logprobs(req)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=_stop(req.stop),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias, vocab_size),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=req.n or 1,
        structured=_constraint(req.response_format, forced_call),
    )


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP:
        raise BadRequest(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    if any(not s for s in stops):
        raise BadRequest("stop sequences must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise BadRequest(
            f"stop sequences must be at most {MAX_STOP_CHARS} characters long", param="stop"
        )
    return stops


def _logprobs(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, int]:
    """(logprobs, top_logprobs). Chat asks with `logprobs: true` and `top_logprobs: k`; the
    legacy completions API with `logprobs: k` alone (k = 0 reports the chosen token only)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs is not None, req.logprobs or 0
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return bool(req.logprobs), req.top_logprobs or 0


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """Keys are token ids written as decimal strings, each in [0, vocab_size), without leading
    zeros: "7" and "07" would be two keys of one token, their biases added past the bound."""
    if not bias:
        return ()
    entries = []
    for key, value in bias.items():
        if (
            not (key.isascii() and key.isdecimal() and len(key) <= 10 and key == str(int(key)))
            or int(key) >= vocab_size
        ):
            raise BadRequest(
                f"logit_bias keys must be token ids from 0 to {vocab_size - 1} without leading "
                f"zeros, got {key[:32]!r}",
                param="logit_bias",
            )
        entries.append((int(key), float(value)))
    return tuple(sorted(entries))


def _constraint(fmt: ResponseFormat | None, forced_call: str | None) -> StructuredOutput | None:
    """The output's constraint, its size checked. Whether it compiles is checked before the
    prompt is tokenized, bounded in time (gateway.prompt_tokens, gateway.schema_checks)."""
    try:
        structured = structured_output(fmt)
        if forced_call is None:
            return structured
        if structured is not None:
            raise BadRequest(
                "response_format cannot constrain an output that must be a tool call",
                param="response_format",
            )
        return StructuredOutput("json_schema", forced_call)
    except StructuredOutputError as exc:
        raise BadRequest(str(exc), param=schema_param(forced_call)) from None


def schema_param(forced_call: str | None) -> str:
    """The request field that holds the schema constraining the output."""
    return "response_format" if forced_call is None else "tools"


def structured_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """The engine's constraint for `response_format`; None for text. A json_schema format
    without a schema constrains to any JSON object. The schema's text keeps its keys in the
    order the client wrote them: the grammar generates an object's properties in the order its
    schema lists them (as OpenAI's do), so `reasoning` listed before `answer` comes first."""
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput("json_object")
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema
        if schema is None:
            return StructuredOutput("json_object")
        return StructuredOutput("json_schema", json.dumps(schema))
    return None
