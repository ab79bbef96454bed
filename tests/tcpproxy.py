"""A TCP proxy on a free loopback port in front of a server, that a test can cut and restore:
an outage of the server as its clients see it (connections reset, new ones refused), without
touching the server others use.

``cut()`` closes every open connection, and resets each new one at once (counted in
``refused``, so that a test waits for a client's retries, never for a time): a server that went
away, as its clients see it; ``restore()`` forwards again, on the same port.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

__all__ = ["TcpProxy", "running_proxy"]


class TcpProxy:
    """See the module docstring. Use through :func:`running_proxy`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._links: set[socket.socket] = set()
        self._closed = False
        self._listener = self._listen(0)
        self.port: int = self._listener.getsockname()[1]
        self._cut = False
        self.refused = 0
        self._start(self._accept, self._listener)

    def _listen(self, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        return listener

    @staticmethod
    def _start(target: object, *args: object) -> None:
        threading.Thread(target=target, args=args, daemon=True).start()  # type: ignore[arg-type]

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            if self._cut:
                self._refuse(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                # A cut made while this connection was being made to the server cuts it too
                # (else it would outlive the cut, and its client never see the outage).
                cut = self._cut
                if not cut:
                    self._links |= {client, server}
            if cut:
                server.close()
                self._refuse(client)
                continue
            self._start(self._pipe, client, server)
            self._start(self._pipe, server, client)

    def _refuse(self, client: socket.socket) -> None:
        self.refused += 1
        # Reset, not a clean close: no server ever answers on it.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                self._links -= {source, sink}

    def cut(self) -> None:
        """Close every connection; reset new ones (counted in ``refused``)."""
        with self._lock:
            self._cut = True
            self.refused = 0
            links, self._links = list(self._links), set()
        for sock in links:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        """Forward again."""
        self._cut = False

    def close(self) -> None:
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            links, self._links = list(self._links), set()
        for sock in links:
            sock.close()


@contextmanager
def running_proxy(host: str, port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy((host, port))
    try:
        yield proxy
    finally:
        proxy.close()
