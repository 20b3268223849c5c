"""A cap on request body size: past it, 413 in the OpenAI error shape, before the body is parsed.

Without it a client could make the server buffer (and JSON-parse) an arbitrarily large body.
Plain ASGI, like the access log. The bytes actually received are counted, whatever the headers
declare: a declared `Content-Length` over the cap is refused at once, and any body (declared,
chunked, or lying about its length) is refused as soon as what arrived passes the cap. Framing
that two parsers could read differently is refused with 400 before any body is read: both
`Content-Length` and `Transfer-Encoding` (the request-smuggling shape, RFC 9112 section 6.3),
several `Content-Length` headers, or one that is not a number. (Raising from inside the app's
reads would not do: FastAPI turns any error while reading a body into a 400.)

All bodies together are bounded too (`max_buffered_bytes`): a body's bytes count from their arrival
until its request's answer has been sent (the parsed request holds them that long), and a body
that would take the total past the bound is refused with 503 and Retry-After. One client can send
at most one body's cap; many together at most the buffered bound.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvasir.runtime.server.errors import APIError


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, max_buffered_bytes: int, retry_after: int = 1) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.retry_after = retry_after
        self.buffered = 0  # bytes of every body held now (one event loop: no lock needed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        lengths = [value for name, value in headers if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in headers)
        if lengths and chunked:
            await self._bad_framing(scope, receive, send, "both Content-Length and Transfer-Encoding")
            return
        if len(lengths) > 1 or (lengths and not lengths[0].strip().isdigit()):
            await self._bad_framing(scope, receive, send, "an invalid or repeated Content-Length")
            return
        if lengths and int(lengths[0]) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        held = 0
        try:
            chunks: list[bytes] = []
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left before finishing its body
                    return
                chunk = message.get("body", b"")
                if held + len(chunk) > self.max_bytes:
                    await self._refuse(scope, receive, send)
                    return
                if self.buffered + len(chunk) > self.max_buffered_bytes:
                    await self._busy(scope, receive, send)
                    return
                held += len(chunk)
                self.buffered += len(chunk)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            await self.app(scope, _replay(b"".join(chunks), receive), send)
        finally:
            self.buffered -= held

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than the server accepts ({self.max_bytes} bytes; --max-request-bytes)",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)

    async def _busy(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            503,
            "the server is receiving too many request bodies at once (--max-buffered-request-bytes); retry",
            code="server_busy",
            headers={"Retry-After": str(self.retry_after)},
        )
        await error.response()(scope, receive, send)

    async def _bad_framing(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        error = APIError(400, f"the request has {what}: its body length is ambiguous", code="bad_framing")
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first hands over the buffered body, then waits on the client (disconnects)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
