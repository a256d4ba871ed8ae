"""The engine's error hierarchy. Each error is a user-facing refusal with a clear message;
callers (the gateway) map the classes to HTTP statuses in one place."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as given; nothing was queued."""


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested completion does not fit in the model's context."""

    def __init__(self, message: str, prompt_tokens: int | None = None):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        """The prompt's length in tokens, when it was tokenized."""


class UnknownAdapterError(InvalidRequestError):
    """The request names an adapter the engine does not serve (never registered, or retired)."""


class UnsupportedModelError(EngineError):
    """The checkpoint is not a model this engine can serve."""


class EngineOverloadedError(EngineError):
    """The waiting queue is full; retry later."""


class EngineStoppedError(EngineError):
    """The engine has been shut down."""


class RequestFailedError(EngineError):
    """The engine could not finish this request (its model output was not finite, or computing
    it raised). Only this request failed, after it was queued; the engine keeps serving."""


class AdapterUnavailableError(RequestFailedError):
    """The request's adapter could not be loaded: its files were deleted, became unreadable or
    changed on disk since it was registered. Only requests for that adapter fail; the next one
    after them tries loading it again."""


class StructuredOutputFailedError(RequestFailedError):
    """The request's structured output failed partway through generation: its grammar ran past
    the grammar library's limits (or the library failed on it) after admission. Only the
    request's own schema drives its grammar, so this is the client's error, not the engine's."""


def number_text(value: int | float) -> str:
    """A number for an error message. An integer too long to print whole is described instead:
    Python refuses to turn one of more than 4,300 digits into text, and a message should not
    grow with a hostile request."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)
