"""Connections that never finish their request are closed: uvicorn's HTTP/1.1 protocol (h11) with
a deadline per request.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and caps a request's buffered
header bytes (`h11_max_incomplete_event_size`), but a client that sends a header line every few
seconds, or a body one byte at a time, keeps its socket and its buffers forever (slowloris). Here
the first byte of a request starts a clock; if the request (headers and body) is not complete
within `--request-read-timeout`, the server answers 408 when it has not answered yet, and closes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": "the request did not arrive in time (--request-read-timeout)",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
_REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


def deadline_protocol(read_timeout: float) -> type[H11Protocol]:
    """An h11 protocol class whose requests must arrive within `read_timeout` seconds."""

    class DeadlineH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is a slow request too

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._cancel_deadline()  # the request is complete (or the connection is done)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = asyncio.get_running_loop().call_later(read_timeout, self._too_slow)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or not cycle.response_started:  # no answer started: say why first
                self.transport.write(_REQUEST_TIMEOUT_RESPONSE)
                if cycle is not None:
                    cycle.disconnected = True  # the app, still waiting for the body, sees a disconnect
            self.logger.info("closed a connection whose request took over %.1fs to arrive", read_timeout)
            self.transport.close()

    return DeadlineH11Protocol


def uvicorn_http_settings(read_timeout: float, keep_alive_timeout: float) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that bound what a slow client can hold."""
    return {
        "http": deadline_protocol(read_timeout),
        "timeout_keep_alive": keep_alive_timeout,
        "h11_max_incomplete_event_size": 16 * 1024,  # header bytes buffered for one request
    }
