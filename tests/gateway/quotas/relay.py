"""A TCP relay to Redis whose open connections can stall: what a client sends on them waits in
the network, in order, while new connections get through (a congested path, packets being
retransmitted). Bytes a client sent before it closed its socket are still delivered, as TCP
does: a command whose caller gave up can reach Redis after the commands that followed it."""

from __future__ import annotations

import contextlib
import socket
import threading


class StallingRelay:
    """Relays TCP connections from a port of 127.0.0.1 to `target_port`.

    `stall()`: what clients send on the connections open now is held until `let_go()`.
    `held` is set once a stalled connection holds bytes; `answered` once Redis has replied to
    bytes that were held (whether or not their client still listens). Both are
    threading.Events: wait on them from a thread (`asyncio.to_thread`)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: list[_Connection] = []
        self._gate = threading.Event()
        self.held = threading.Event()
        self.answered = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall(self) -> None:
        with self._lock:
            for c in self._open:
                c.stalled = True

    def let_go(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self._gate.set()
        self._listener.close()
        with self._lock:
            sockets = [s for c in self._open for s in (c.client, c.server)]
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            c = _Connection(client, socket.create_connection(("127.0.0.1", self.target_port)))
            with self._lock:
                self._open.append(c)
            threading.Thread(target=self._up, args=(c,), daemon=True).start()
            threading.Thread(target=self._down, args=(c,), daemon=True).start()

    def _up(self, c: _Connection) -> None:
        with contextlib.suppress(OSError):
            while data := c.client.recv(65536):
                if c.stalled:
                    self.held.set()
                    self._gate.wait()
                    c.delayed = True
                c.server.sendall(data)
        with contextlib.suppress(OSError):
            c.server.shutdown(socket.SHUT_WR)

    def _down(self, c: _Connection) -> None:
        with contextlib.suppress(OSError):
            while data := c.server.recv(65536):
                if c.delayed:
                    self.answered.set()
                with contextlib.suppress(OSError):
                    c.client.sendall(data)
        with contextlib.suppress(OSError):
            c.client.shutdown(socket.SHUT_WR)


class _Connection:
    def __init__(self, client: socket.socket, server: socket.socket):
        self.client = client
        self.server = server
        self.stalled = False
        self.delayed = False
        """Bytes held by a stall were sent on: what Redis answers now replies to them."""
