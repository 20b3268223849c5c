"""A backend on a raw socket, for what no HTTP server would send: it answers the router's /metrics
scrapes as an idle Kvasir server would, and every other request with fixed bytes (garbage, a bad
status line, oversized headers), or never."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tests.router.stub_backend import TIMEOUT

_METRICS = (
    b'kvasir_requests_waiting{model_name="raw"} 0\n'
    b'kvasir_requests_running{model_name="raw"} 0\n'
    b'kvasir_kv_cache_usage_ratio{model_name="raw"} 0\n'
)


class RawBackend:
    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer  # None: read the request, then say nothing until stopped
        self.hits = 0  # requests other than /metrics
        self.holding = threading.Event()  # set once a request is held unanswered
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    body += chunk
                if head.split(b" ")[1] == b"/metrics":
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                        + b"content-length: %d\r\n\r\n" % len(_METRICS)
                        + _METRICS
                    )
                    return
                self.hits += 1
                if self.answer is None:
                    self.holding.set()
                    self._stop.wait(TIMEOUT)
                    return
                conn.sendall(self.answer)
            except OSError:
                return

    @contextmanager
    def running(self) -> Iterator[RawBackend]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            with contextlib.suppress(OSError):
                self._sock.close()
            self._thread.join(TIMEOUT)
