"""A request's prompt as token ids, checked against the model: the one tokenization of a request,
wherever it runs (the gateway, before a request crosses to the engine; the engine, for callers
in its own process)."""

from __future__ import annotations

from typing import Any

from loramux.engine.chat_prompt import chat_prompt_ids, text_prompt_ids
from loramux.engine.errors import InvalidRequestError, PromptTooLongError, number_text
from loramux.engine.outputs import EngineRequest


def prompt_token_ids(
    tokenizer: Any, request: EngineRequest, vocab_size: int, max_model_len: int
) -> list[int]:
    """Token ids of the request's prompt (chat template applied to messages). Raises
    InvalidRequestError (PromptTooLongError when it cannot fit with its max_tokens)."""
    forms = [request.prompt, request.prompt_token_ids, request.messages]
    if sum(f is not None for f in forms) != 1:
        raise InvalidRequestError("give exactly one of prompt, prompt_token_ids or messages")
    if request.tools is not None and request.messages is None:
        raise InvalidRequestError("tools go with messages")
    if request.messages is not None:
        if not request.messages:
            raise InvalidRequestError("messages must not be empty")
        ids = chat_prompt_ids(tokenizer, request.messages, request.tools)
    elif request.prompt is not None:
        ids = text_prompt_ids(tokenizer, request.prompt)
    else:
        ids = list(request.prompt_token_ids or [])
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if not ids:
        raise InvalidRequestError("the prompt is empty")
    if len(ids) + request.params.max_tokens > max_model_len:
        raise PromptTooLongError(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{len(ids)} prompt tokens and asks for {number_text(request.params.max_tokens)} "
            "completion tokens",
            len(ids),
        )
    return ids
