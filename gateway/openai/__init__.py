"""The OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models."""

from loramux.gateway.openai.routes import openai_router

__all__ = ["openai_router"]
