"""`loramux serve --workers N`: N gateway processes in front of one engine core and one Redis.

Each worker is a supervised child of serve running `loramux serve --workers 1` with the parent's
redis-server and engine named as external ones (LORAMUX_REDIS_URL, LORAMUX_ENGINE_URLS), so it
spawns no children of its own. All workers bind the same port with SO_REUSEPORT and the kernel
spreads connections over them. What must be exact across workers already lives outside them:
tenants, keys and adapters in the database (and the adapter store in the data directory), quotas
and the response cache in Redis; so an adapter uploaded through one worker serves through all.

The workers' own metrics add up across them: prometheus-client's multiprocess mode, its files in
`<data dir>/metrics` (emptied at each start), so that a scrape of the shared port counts every
worker's requests whichever worker answers (gateway.metrics). The engine's series come from the
engine itself and are the same from any worker.

Each worker also answers on a Unix socket of its own, which serve probes for its readiness (on the
shared port any worker could answer). Worker 0 starts first and alone, so the first-start setup
(the demo tenant) runs once.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import httpx

from loramux.gateway.supervisor import ChildSpec

START_SECONDS = 300.0
"""How long a worker may take to import the gateway and answer /ready."""
MAX_WORKERS = 8
MAX_SOCKET_PATH = 100
"""A Unix socket's path has room for 107 bytes; a deeper data directory gets a temporary one."""


MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client's variable: set, its metrics live in shared files in that folder."""


def metrics_folder(data_dir: Path) -> Path:
    """An empty folder for this start's worker metrics (the last start's counts are gone)."""
    folder = data_dir.resolve() / "metrics"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True)
    return folder


CGROUP = Path("/sys/fs/cgroup")


def available_cores() -> int:
    """The cores this process may use: its CPU affinity (a cpuset, as `docker run --cpuset-cpus`
    sets), at most the CPUs its cgroup's quota allows (`docker run --cpus`, a Kubernetes CPU
    limit), which the affinity does not show: a pod limited to 2 CPUs on a 64-core host must not
    start 32 workers and a 32-thread engine."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    quota = cgroup_cpu_quota(CGROUP)
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_cpu_quota(root: Path) -> int | None:
    """CPUs the quota of the cgroup mounted at `root` allows, rounded up; None without one (or
    when it cannot be read). cgroup v2's `cpu.max` ("<quota> <period>", or "max ..."), else v1's
    `cpu/cpu.cfs_quota_us` over `cpu/cpu.cfs_period_us` (-1: none)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def default_workers() -> int:
    """One worker per two cores (the engine core and Redis need the rest), 1 to MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, available_cores() // 2))


def worker_child(
    index: int, host: str, port: int, data_dir: Path, shared: dict[str, str]
) -> ChildSpec:
    """Worker `index`, serving on `host`:`port` with the redis-server and engine that `shared`
    (LORAMUX_* variables) names."""
    control = _control_socket(data_dir, index)
    argv: tuple[str, ...] = (sys.executable, "-m", "loramux.gateway.cli", "serve", "--workers", "1")
    argv += ("--host", host, "--port", str(port), "--reuse-port", "--control-socket", str(control))

    async def ready() -> bool:
        transport = httpx.AsyncHTTPTransport(uds=str(control))
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
            return (await client.get("http://worker/ready")).status_code == 200

    return ChildSpec(f"gateway-{index}", argv, ready, START_SECONDS, os.environ | shared)


def listening_sockets(host: str, port: int, control: Path | None) -> list[socket.socket]:
    """The shared port, bound with SO_REUSEPORT so that every worker can bind it, and the
    worker's own control socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    shared = socket.socket(family, socket.SOCK_STREAM)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    shared.bind((host, port))
    sockets = [shared]
    if control is not None:
        control.unlink(missing_ok=True)  # left by a worker that was killed
        own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own.bind(str(control))
        sockets.append(own)
    return sockets


def _control_socket(data_dir: Path, index: int) -> Path:
    folder = data_dir.resolve() / "workers"
    if len(str(folder)) + 12 > MAX_SOCKET_PATH:
        folder = Path(tempfile.mkdtemp(prefix="loramux-workers-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{index}.sock"
