"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models."""

from litestar.types import ControllerRouterHandler

from gateway.openai.routes import chat_completions, completions, list_models

openai_routes: list[ControllerRouterHandler] = [chat_completions, completions, list_models]
