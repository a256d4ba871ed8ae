"""`loramux serve --workers N`: N gateway processes in front of one engine core and one Redis.

Each worker is a supervised child of serve running `loramux serve --workers 1` with the parent's
redis-server and engine named as external ones (LORAMUX_REDIS_URL, LORAMUX_ENGINE_URLS), so it
spawns no children of its own. Serve binds the port once, before it starts anything, and every
worker serves on that one socket, inherited (`--listen-fd`): each accepts from its queue when
free. (Each binding the port with SO_REUSEPORT let any process of the same user that set it
join: a second serve on another data directory shared the first's port without a word.) What must be exact across workers already lives outside them:
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
from collections.abc import Callable
from pathlib import Path

import httpx

from loramux.gateway.setting_checks import StartError
from loramux.gateway.supervisor import ChildSpec

START_SECONDS = 300.0
"""How long a worker may take to import the gateway and serve (answer /health)."""
MAX_WORKERS = 8
BACKLOG = 2048
"""Connections the port queues until the gateway accepts them (uvicorn's default)."""
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
    limit, a systemd CPUQuota=), which the affinity does not show: a pod limited to 2 CPUs on a
    64-core host must not start 32 workers and a 32-thread engine."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    quota = cgroup_cpu_quota(CGROUP, own_cgroup())
    return max(1, min(cores, quota)) if quota is not None else cores


def own_cgroup(listing: Path = Path("/proc/self/cgroup")) -> str:
    """This process's cgroup v2 path (the `0::` line of /proc/self/cgroup); "/" when unknown."""
    try:
        for line in listing.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        pass
    return "/"


def cgroup_cpu_quota(root: Path, own: str = "/") -> int | None:
    """CPUs the cgroup quota allows, rounded up; None without one (or when it cannot be read).
    cgroup v2 (mounted at `root`): the smallest `cpu.max` ("<quota> <period>", or "max ...") on
    the way from the process's own cgroup `own` up to `root` (a container with its own cgroup
    namespace sees its cgroup as `root`); else v1's `cpu/cpu.cfs_quota_us` over
    `cpu/cpu.cfs_period_us`. A quota or period that is not positive (v1's -1) is no quota."""
    folder = (root / own.strip("/")).resolve()
    quotas = []
    for at in (folder, *folder.parents):
        if not at.is_relative_to(root.resolve()):
            break
        quotas.append(_quota(at / "cpu.max", lambda text: text.split()[:2]))
    v2 = [q for q in quotas if q is not None]
    if v2:
        return min(v2)
    v1 = root / "cpu"
    return _quota(
        v1 / "cpu.cfs_quota_us", lambda text: [text, (v1 / "cpu.cfs_period_us").read_text()]
    )


def _quota(path: Path, fields: Callable[[str], list[str]]) -> int | None:
    """CPUs of the quota and period that `fields` reads from `path`'s text; None for none."""
    try:
        quota, period = (int(field) for field in fields(path.read_text()))
    except (OSError, ValueError):
        return None
    return math.ceil(quota / period) if quota > 0 and period > 0 else None


def default_workers() -> int:
    """One worker per two cores (the engine core and Redis need the rest), 1 to MAX_WORKERS."""
    return max(1, min(MAX_WORKERS, available_cores() // 2))


def worker_child(
    index: int, host: str, port: int, listener: int, data_dir: Path, shared: dict[str, str]
) -> ChildSpec:
    """Worker `index`, serving on `host`:`port` (the socket whose descriptor is `listener`,
    which it inherits) with the redis-server and engine that `shared` (LORAMUX_* variables)
    names."""
    control = _control_socket(data_dir, index)
    argv: tuple[str, ...] = (sys.executable, "-m", "loramux.gateway.cli", "serve", "--workers", "1")
    argv += ("--host", host, "--port", str(port), "--listen-fd", str(listener))
    argv += ("--control-socket", str(control))

    async def ready() -> bool:
        # Serving (/health), not /ready: a worker whose external engine is not up yet serves
        # degraded, and must not be killed as one that never started.
        transport = httpx.AsyncHTTPTransport(uds=str(control))
        async with httpx.AsyncClient(transport=transport, timeout=2.0) as client:
            return (await client.get("http://worker/health")).status_code == 200

    env = os.environ | shared
    return ChildSpec(f"gateway-{index}", argv, ready, START_SECONDS, env, pass_fds=(listener,))


def listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's port, bound and listening before serve starts anything else, so that a
    port in use is refused at once, in one line naming it (uvicorn found it only once the
    gateway was ready to serve, after the first start had printed its key, and exited past
    serve's handling). Without SO_REUSEPORT: no other process can join it; the workers
    inherit this socket (`worker_child`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(BACKLOG)
    except OSError as exc:
        listener.close()
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise StartError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
    return listener


def control_socket(path: Path) -> socket.socket:
    """A worker's own Unix socket, where its parent probes it."""
    path.unlink(missing_ok=True)  # left by a worker that was killed
    own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own.bind(str(path))
    return own


def _control_socket(data_dir: Path, index: int) -> Path:
    folder = data_dir.resolve() / "workers"
    if len(str(folder)) + 12 > MAX_SOCKET_PATH:
        folder = Path(tempfile.mkdtemp(prefix="loramux-workers-"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{index}.sock"
