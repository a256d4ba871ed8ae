"""The engine's internal HTTP service, so gateways and engines can run as separate processes.

`app` serves one AsyncEngine over HTTP, `wire` is the format both sides speak, `runner` starts it.
"""

from engine.service.app import create_engine_app
from engine.service.runner import run_engine_service, serve_engine_in_thread

__all__ = ["create_engine_app", "run_engine_service", "serve_engine_in_thread"]
