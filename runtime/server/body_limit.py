"""A cap on request body size: past it, 413 in the OpenAI error shape, before the body is parsed.

Without it a client could make the server buffer (and JSON-parse) an arbitrarily large body.
Plain ASGI, like the access log: a declared `Content-Length` over the cap is refused at once; a
body without one (chunked) is read here, up to the cap, and handed on whole, or refused as soon as
it passes the cap. (Raising from inside the app's reads would not do: FastAPI turns any error
while reading a body into a 400.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvasir.runtime.server.errors import APIError


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
            else:  # the ASGI server holds the client to its declared length
                await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before finishing its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than the server accepts ({self.max_bytes} bytes; --max-request-bytes)",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first hands over the buffered body, then waits on the client (disconnects)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
