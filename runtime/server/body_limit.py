"""A cap on request body size: past it, 413 in the OpenAI error shape, before the body is parsed.

Without it a client could make the server buffer (and JSON-parse) an arbitrarily large body.
Plain ASGI, like the access log, and torch- and framework-free: `kvasir router` reads its bodies
with the same `BodyLimits`. The bytes actually received are counted, whatever the headers declare:
a declared `Content-Length` over the cap is refused at once, and any body (declared, chunked, or
lying about its length) is refused as soon as what arrived passes the cap. Framing that two
parsers could read differently is refused with 400 before any body is read, and the connection is
closed: both `Content-Length` and `Transfer-Encoding` (the request-smuggling shape, RFC 9112
section 6.3), several `Content-Length` headers, or one that is not a number. (The HTTP protocol,
`http_protocol`, refuses the first two before the app sees the request; this is the same rule for
an app served without it.) (Raising from inside the app's reads would not do: FastAPI turns any
error while reading a body into a 400.)

All bodies together are bounded too (`max_buffered_bytes`): a body's bytes count from their arrival
until its request's answer has been sent (the parsed request holds them that long), and a body
that would take the total past the bound is refused with `busy_status` (503 for the server, 429
for the router) and Retry-After. One client can send at most one body's cap; many together at most
the buffered bound.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# status -> OpenAI error type, as the server's errors.ERROR_TYPES
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


def error_json(status: int, message: str, code: str | None, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}`, as the server's APIError writes it."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json.dumps({"error": error}, ensure_ascii=False, separators=(",", ":")).encode()


async def send_error(
    send: Send,
    status: int,
    message: str,
    code: str | None,
    *,
    param: str | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """One complete JSON error answer. A `connection: close` among `headers` makes the HTTP
    protocol close the connection once it is sent."""
    body = error_json(status, message, code, param)
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*start, *headers]})
    await send({"type": "http.response.body", "body": body})


def framing_problem(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """What makes a request's body length ambiguous (RFC 9112 section 6.3), or None."""
    headers = list(headers)
    lengths = [value for name, value in headers if name.lower() == b"content-length"]
    chunked = any(name.lower() == b"transfer-encoding" for name, _ in headers)
    if lengths and chunked:
        return "both Content-Length and Transfer-Encoding"
    if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
        return "an invalid or repeated Content-Length"
    return None


class BodyLimits:
    """One body's cap and the bound on all bodies held at once (`buffered`: bytes held now; one
    event loop, so no lock)."""

    def __init__(
        self,
        max_bytes: int,
        max_buffered_bytes: int,
        *,
        busy_status: int = 503,
        retry_after: int = 1,
        who: str = "server",
    ) -> None:
        self.max_bytes = max_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.busy_status = busy_status
        self.retry_after = retry_after
        self.who = who
        self.buffered = 0

    @asynccontextmanager
    async def hold(self, scope: Scope, receive: Receive, send: Send) -> AsyncIterator[bytes | None]:
        """The request's whole body, counted against the bound until the block ends; None when it
        was refused (the answer has been sent) or the client left before finishing it."""
        problem = framing_problem(scope.get("headers", ()))
        if problem is not None:
            what = f"the request has {problem}: its body length is ambiguous"
            await send_error(send, 400, what, "bad_framing", headers=[(b"connection", b"close")])
            yield None
            return
        lengths = [value for name, value in scope.get("headers", ()) if name.lower() == b"content-length"]
        if lengths and int(lengths[0]) > self.max_bytes:
            await self._too_large(send)
            yield None
            return
        held = 0
        try:
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left before finishing its body
                    yield None
                    return
                chunk = message.get("body", b"")
                if held + len(chunk) > self.max_bytes:
                    await self._too_large(send)
                    yield None
                    return
                if self.buffered + len(chunk) > self.max_buffered_bytes:
                    await self._busy(send)
                    yield None
                    return
                held += len(chunk)
                self.buffered += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            body = b"".join(chunks)
            del chunks
            yield body
        finally:
            self.buffered -= held

    async def _too_large(self, send: Send) -> None:
        message = f"the request body is larger than the {self.who} accepts ({self.max_bytes} bytes; --max-request-bytes)"
        await send_error(send, 413, message, "request_too_large")

    async def _busy(self, send: Send) -> None:
        message = f"the {self.who} is receiving too many request bodies at once (--max-buffered-request-bytes); retry"
        await send_error(
            send,
            self.busy_status,
            message,
            "server_busy",
            headers=[(b"retry-after", str(self.retry_after).encode())],
        )


class BodySizeLimitMiddleware:
    """The server's bodies, read whole within `BodyLimits` before the app runs."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_buffered_bytes: int, retry_after: int = 1) -> None:
        self.app = app
        self.limits = BodyLimits(max_bytes, max_buffered_bytes, retry_after=retry_after)

    @property
    def buffered(self) -> int:
        return self.limits.buffered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        async with self.limits.hold(scope, receive, send) as body:
            if body is not None:
                await self.app(scope, _replay(body, receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first hands over the buffered body, then waits on the client (disconnects)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
