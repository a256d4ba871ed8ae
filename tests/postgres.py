"""A throwaway PostgreSQL server for the tests that need a real one (fixtures `postgres_url`,
and `postgres_server` to stop and start it).

The server is started from the installed binaries (`./bootstrap.sh test` installs Debian's
`postgresql`): a fresh cluster in a temporary folder, trust authentication, listening on
127.0.0.1 at a free port with its socket in that folder, durability off (fsync) for speed.
PostgreSQL refuses to run as root, so under root the cluster belongs to the `postgres` OS user.
Without PostgreSQL the tests that use it are skipped, or fail when `CI` is set.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

DATABASE = "loramux_test"
INITDB_OPTIONS = ["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync"]
SERVER_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"


def postgres_bin_dir() -> Path | None:
    """The folder of `initdb`/`pg_ctl`: on the PATH, else Debian's newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_major_version)
    return Path(candidates[-1]).parent if candidates else None


def _major_version(pg_ctl: str) -> int:
    name = Path(pg_ctl).parent.parent.name
    return int(name) if name.isdigit() else 0


def server_user() -> list[str]:
    """The command prefix that runs a PostgreSQL binary: as `postgres` under root, else as is."""
    if os.geteuid() != 0:
        return []
    if subprocess.run(["id", "-u", "postgres"], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "postgres"], check=True)
    return ["runuser", "-u", "postgres", "--"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


@dataclass(frozen=True)
class PostgresServer:
    """One running server: `url` of its database `loramux_test`; `stop` and `start` it again
    (the same port and data). `stop` does not wait for clients: it ends their sessions. (Not an
    immediate stop: with durability off, that would lose the last commits.)"""

    url: str
    pg_ctl: list[str]
    options: str
    root: Path

    def stop(self) -> None:
        _run([*self.pg_ctl, "-m", "fast", "-w", "stop"], self.root)

    def start(self) -> None:
        log = self.root / "server.log"
        try:
            _run([*self.pg_ctl, "-l", str(log), "-o", self.options, "-w", "start"], self.root)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nserver log:\n{log.read_text(errors='replace')}") from None


@contextlib.contextmanager
def running_postgres(bin_dir: Path) -> Iterator[PostgresServer]:
    """Start a server on a fresh cluster with database `loramux_test`; stop and delete it on exit."""
    as_user = server_user()
    # Not under pytest's tmp_path (nor $TMPDIR, under root): its root is mode 0700 and root's,
    # closed to the postgres user. /tmp also keeps the socket path short (107 bytes at most).
    root = Path(tempfile.mkdtemp(prefix="loramux-postgres-", dir="/tmp" if as_user else None))
    if as_user:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", free_port()
    pg_ctl = [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data)]
    try:
        _run([*as_user, str(bin_dir / "initdb"), "-D", str(data), *INITDB_OPTIONS], root)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} {SERVER_OPTIONS}"
        url = f"postgresql://postgres@127.0.0.1:{port}/{DATABASE}"
        server = PostgresServer(url, pg_ctl, options, root)
        server.start()
        try:
            createdb = [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port)]
            _run([*createdb, "-U", "postgres", DATABASE], root)
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A server that lives for the session (tests that stop it start it again)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        message = (
            "PostgreSQL is not installed (apt-get install postgresql; ./bootstrap.sh test does)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with running_postgres(bin_dir) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """`postgresql://postgres@127.0.0.1:PORT/loramux_test` on the session's server."""
    return postgres_server.url
