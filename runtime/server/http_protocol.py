"""uvicorn's HTTP/1.1 protocol (h11) with the rules a client cannot talk its way around.

- **A deadline per request.** uvicorn closes idle keep-alive connections (`timeout_keep_alive`), but a
  client that sends a header line every few seconds, or a body one byte at a time, would keep its
  socket and buffers forever (slowloris). The first byte of a request starts a clock; if the request
  (headers and body) is not complete within `--request-read-timeout`, the server answers 408 when it
  has not answered yet, and closes.
- **A cap on header bytes, however they arrive.** h11 bounds only a head that is still incomplete
  (`max_incomplete_event_size`): a head of 10,000 headers sent in one write was parsed whole. Here
  any request head over `MAX_HEAD_BYTES` is answered 431, and every refusal at this level is a JSON
  error in the OpenAI shape (uvicorn's own is plain text).
- **No ambiguous framing.** A request with both `Content-Length` and `Transfer-Encoding` can be read
  two ways (request smuggling: a second request hidden in the first one's body, as another hop reads
  it). RFC 9112 section 6.3: it is answered 400 and the connection is closed, before the app sees
  it, so nothing sent after it on that connection is ever read.
- **A half-closed client is still there.** A client may shut its sending side once its request is
  complete (`shutdown(SHUT_WR)`, `nc -N`) and wait for the answer. uvicorn let the transport close on
  that end of file, which the app took for a disconnect and aborted the request. Here the connection
  stays open for the answer; the client counts as gone only when a write to it fails (a stream
  notices at its next token, a non-streamed answer when it is sent), and the connection closes once
  the answer is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvasir.runtime.server.printable import printable

MAX_HEAD_BYTES = 16 * 1024  # request line and headers; nginx's default large buffers are 4 x 8 KiB


def _error_body(message: str, code: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": error}).encode()


_TIMEOUT_BODY = _error_body("the request did not arrive in time (--request-read-timeout)", "request_timeout")
_REQUEST_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


class _AmbiguousFraming(h11.RemoteProtocolError):
    """A request head declaring both a length and a transfer coding."""


class _HeadLimitedConnection(h11.Connection):
    """h11's server side, refusing any request head over `max_head_bytes` (h11 itself bounds only a
    head still incomplete) or with ambiguous framing (h11 itself reads `Transfer-Encoding` and
    ignores `Content-Length`), and keeping the last refusal for the answer."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as error:
            self.refusal = error
            raise
        if isinstance(event, h11.Request) and _head_size(event) > self.max_head_bytes:
            self.refusal = h11.RemoteProtocolError("request head too large", error_status_hint=431)
            raise self.refusal
        if isinstance(event, h11.Request) and _ambiguous_framing(event):
            self.refusal = _AmbiguousFraming(
                "both Content-Length and Transfer-Encoding: the body length is ambiguous",
                error_status_hint=400,
            )
            raise self.refusal
        return event


def _ambiguous_framing(request: h11.Request) -> bool:
    names = {name for name, _ in request.headers}  # h11 lower-cases them
    return b"content-length" in names and b"transfer-encoding" in names


def _head_size(request: h11.Request) -> int:
    """The bytes of the request line and headers as sent (less any spaces h11 trimmed)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


def kvasir_protocol(read_timeout: float, max_head_bytes: int = MAX_HEAD_BYTES) -> type[H11Protocol]:
    """The h11 protocol class with the rules above."""

    class KvasirH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _client_done = False  # the client half-closed after a complete request

        conn: _HeadLimitedConnection

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = _HeadLimitedConnection(max_head_bytes)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is a slow request too

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
                self._cancel_deadline()  # the request is complete (or the connection is done)

        def eof_received(self) -> bool | None:  # type: ignore[override]
            answering = self.cycle is not None and not self.cycle.response_complete
            if answering and self.conn.their_state is h11.DONE:
                self._client_done = True
                return True  # keep the transport open: the answer is still to be written
            return None  # the transport closes (and an unfinished request sees a disconnect)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._client_done:
                self.transport.close()  # the client cannot send another request

        def send_400_response(self, msg: str) -> None:
            refusal = self.conn.refusal
            status = refusal.error_status_hint if refusal is not None else 400
            if status == 431:
                body = _error_body(
                    f"the request's headers are larger than the server accepts ({max_head_bytes} bytes)",
                    "request_header_fields_too_large",
                )
            elif isinstance(refusal, _AmbiguousFraming):
                body = _error_body(f"the request has {refusal}", "bad_framing")
            else:
                detail = printable(str(refusal), 200) if refusal is not None else msg
                body = _error_body(f"Invalid HTTP request: {detail}", "bad_http_request")
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            reason = HTTPStatus(status).phrase.encode()
            response = h11.Response(status_code=status, headers=headers, reason=reason)
            events = (response, h11.Data(data=body), h11.EndOfMessage())
            # If an answer had started already, closing is all that is left.
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(b"".join(self.conn.send(event) or b"" for event in events))
            self.transport.close()

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

    return KvasirH11Protocol


def uvicorn_http_settings(read_timeout: float, keep_alive_timeout: float) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that bound what a client can hold or send."""
    return {
        "http": kvasir_protocol(read_timeout),
        "timeout_keep_alive": keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }
