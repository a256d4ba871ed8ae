"""The engine as a service of its own process: a ZeroMQ channel for gateways (`wire` is what
both ends speak, `server` the engine end) and one HTTP endpoint for health and metrics
(`health`); `runner` starts them."""

from loramux.engine.service.runner import Listen, run_engine_service, serve_engine_in_thread

__all__ = ["Listen", "run_engine_service", "serve_engine_in_thread"]
