"""Hotspots of a gateway's event-loop thread: cProfile around one window of requests."""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _on_loop(loop: asyncio.AbstractEventLoop, action: Callable[[], object]) -> None:
    """Call `action` on `loop`'s thread from a plain callback, and wait for it. (Not from a
    task: the profiler would then charge the task's creation with the whole window.)"""
    done = threading.Event()

    def call() -> None:
        action()
        done.set()

    loop.call_soon_threadsafe(call)
    done.wait()


def profile_gateway(
    loop: asyncio.AbstractEventLoop, run_window: Callable[[], int], top: int = 20
) -> dict[str, Any]:
    """cProfile on the gateway's event-loop thread (`loop`'s) while `run_window()` sends requests
    through it (it returns how many): the functions with the most own time per request, idle
    waits in epoll left out. Times are wall time, so a call that releases the GIL (a socket send)
    includes waiting to take it back from the gateway's other threads; cProfile inflates
    pure-Python functions, so compare them with each other."""
    profiler = cProfile.Profile()
    _on_loop(loop, profiler.enable)
    n = run_window()
    _on_loop(loop, profiler.disable)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    busy = {k: v for k, v in stats.items() if "select.epoll" not in k[2]}
    rows = sorted(busy.items(), key=lambda item: item[1][2], reverse=True)
    return {
        "requests": n,
        "busy_ms_per_request": sum(v[2] for v in busy.values()) / n * 1000,
        "top_by_own_time": [
            {
                "function": f"{'/'.join(Path(file).parts[-2:])}:{line}({func})",
                "calls_per_request": round(calls / n, 2),
                "own_us_per_request": round(own / n * 1e6, 1),
                "cumulative_us_per_request": round(cum / n * 1e6, 1),
            }
            for (file, line, func), (_, calls, own, cum, _) in rows[:top]
        ],
    }
