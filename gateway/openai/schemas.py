"""OpenAI request bodies as msgspec structs.

Every number is bounded in its type, so msgspec's decode refuses NaN, infinity (`1e400` decodes
to it), integers past 64 bits and out-of-range values with a 400 naming the field before
anything is tokenized or queued. Rules across fields (top_logprobs needs logprobs, logit_bias
keys are token ids) are checked where the request becomes sampling parameters
(`gateway.openai.sampling`). Fields OpenAI has but loramux does not serve are declared so they
are refused with a clear 400 rather than silently ignored (`refuse_unsupported`).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.tools.schemas import MAX_TOOLS, Tool, ToolCall, ToolChoice

INT32_MAX = 2**31 - 1
MAX_N = 16
"""Most choices one request may ask for (the engine's own limit)."""
MAX_LOGIT_BIAS = 300
"""Most logit_bias entries (OpenAI's limit)."""

TokenCount = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=100.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[str, Bias], Meta(max_length=MAX_LOGIT_BIAS)]
Choices = Annotated[int, Meta(ge=1, le=MAX_N)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
CompletionLogprobs = Annotated[int, Meta(ge=0, le=5)]
SchemaName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class CacheOptions(msgspec.Struct, forbid_unknown_fields=True):
    """loramux extension: per-request response-cache control."""

    semantic: bool | None = None
    ttl: int | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    refusal: str | None = None
    """An assistant turn OpenAI refused: its text, the content null (as the SDK hands it back)."""
    name: str | None = None
    """The speaker: passed to a chat template that writes it (`named_roles`)."""
    tool_calls: list[ToolCall] | None = None
    """The calls an assistant turn made."""
    tool_call_id: str | None = None
    """The call a `tool` message answers."""


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(
    msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True
):
    pass


class JsonSchemaSpec(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: SchemaName
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(
    msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True
):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class _Sampling(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    stream: bool | None = None
    """null is false, as in OpenAI's schema (its SDK sends null for `stream=None`)."""
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    """Extension: drop tokens less likely than min_p times the most likely one."""
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: Choices | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    """Extension: transformers' repetition penalty over prompt and output (1 is off)."""
    logit_bias: LogitBias | None = None
    """Token id (as a string) to a bias added to its logit, -100 to 100."""
    response_format: ResponseFormat | None = None
    user: str | None = None
    cache: CacheOptions | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Declared to be refused when used: the deprecated form of tools, and what would change the
    # output in a way loramux cannot serve (audio, a web search, a predicted output)
    functions: list[Any] | None = None
    function_call: Any | None = None
    modalities: list[str] | None = None
    """Refused unless it asks for text alone."""
    audio: Any | None = None
    web_search_options: Any | None = None
    prediction: Any | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    """A string, a list of token ids, or a one-element list of either."""
    logprobs: CompletionLogprobs | None = None
    """How many most likely tokens to report at each position (0 reports the chosen one)."""
    # Declared to be refused when used:
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """400 for parameters loramux does not implement, instead of ignoring them, and for
    `stream_options` on a request that does not stream (as OpenAI refuses it: its
    `include_usage` would be dropped unseen). Fields about OpenAI's own service (`store`,
    `metadata`, `service_tier`, …) change no output here and are ignored (docs/architecture.md,
    "Public API", lists them)."""
    if req.stream_options is not None and not req.stream:
        raise BadRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if isinstance(req, ChatCompletionRequest):
        _refuse_unsupported_chat(req)
        return
    if req.echo:
        raise BadRequest("echo is not supported", param="echo")
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise BadRequest("best_of is not supported", param="best_of")


def _refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    """The chat fields of `refuse_unsupported`: deprecated functions, and output other than text
    (audio), from elsewhere (a web search) or matched against a prediction."""
    if req.functions or req.function_call:
        raise BadRequest("functions and function_call are deprecated; use tools", param="functions")
    if req.modalities and set(req.modalities) != {"text"}:
        raise BadRequest(
            'only text output is served: modalities may hold only "text"', param="modalities"
        )
    unserved = (
        ("audio", req.audio, "audio output is not supported"),
        ("web_search_options", req.web_search_options, "web search is not supported"),
        ("prediction", req.prediction, "predicted outputs are not supported"),
    )
    for param, value, message in unserved:
        if value is not None:
            raise BadRequest(message, param=param)
