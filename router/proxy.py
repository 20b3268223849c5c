"""The router's ASGI app: OpenAI-compatible requests proxied to the best backend, byte for byte.

A request's body is read whole (it is small next to its answer, and a retry needs it again); the
answer is never buffered: each chunk the backend sends is written to the client as it arrives.
Until the first byte of an answer is written, a backend that answers 429 or 503 (full, draining)
or cannot be reached is replaced by the next best one; after it, nothing is retried (the client
could see an answer twice). A backend that breaks off mid-answer gets the client an SSE error event
(a stream) or a closed connection (a JSON body): never a hang. A client that disconnects closes the
connection to the backend, which aborts the request there."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

from kvasir.router.backends import BackendPool
from kvasir.router.lifecycle import RouterLifecycle
from kvasir.router.metrics import RouterMetrics
from kvasir.router.prefix import PrefixIndex, block_keys, prompt_text
from kvasir.router.scorer import Weights, rank

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 32 << 20  # as `kvasir serve`'s default --max-request-bytes
# Headers that describe one connection, not the message (RFC 9110 7.6.1), and those aiohttp sets.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
# The router's server writes its own framing, date and server headers.
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
_RETRY_STATUSES = {429: "status_429", 503: "status_503"}
_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError, asyncio.TimeoutError)


def _json(status: int, message: str, code: str, kind: str = "server_error") -> tuple[int, bytes]:
    error = {"message": message, "type": kind, "param": None, "code": code}
    return status, json.dumps({"error": error}).encode()


class Router:
    """Routing and proxying; `app` below wraps it in ASGI."""

    def __init__(
        self,
        pool: BackendPool,
        prefix: PrefixIndex,
        metrics: RouterMetrics,
        lifecycle: RouterLifecycle,
        weights: Weights,
        *,
        block_chars: int,
        max_attempts: int,
        connect_timeout: float,
    ) -> None:
        self.pool = pool
        self.prefix = prefix
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.weights = weights
        self.block_chars = block_chars
        self.max_attempts = max_attempts
        self.session: aiohttp.ClientSession | None = None  # opened by the app's lifespan
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=None)
        self._rng = random.Random()

    # ---- the ASGI entry point ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            ready = self.lifecycle.accepting and bool(self.pool.backends)
            await _respond(send, 200 if ready else 503, b'{"ready":%s}' % (b"true" if ready else b"false"))
        elif path == "/metrics" and method == "GET":
            await _respond(send, 200, self.metrics.render(), self.metrics.content_type.encode())
        elif path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/version"):
            await self._proxy(scope, receive, send)
        else:
            await _respond(
                send,
                *_json(404, f"{path} is not a route of this router", "not_found", "invalid_request_error"),
            )

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.lifecycle.accepting:
            await _respond(send, *_json(503, "The router is shutting down.", "draining"), retry_after=True)
            return
        try:
            body = await _read_body(receive)
        except _ClientGone:
            return
        if body is None:
            await _respond(
                send,
                *_json(413, "The request body is too large.", "request_too_large", "invalid_request_error"),
            )
            return
        with self.lifecycle.hold():
            # One watcher task per request: when the client leaves, it cancels this one, which
            # closes the backend connection (and so aborts the request there).
            this = asyncio.current_task()
            assert this is not None
            gone = asyncio.ensure_future(_disconnected(receive))
            gone.add_done_callback(lambda watcher: watcher.cancelled() or this.cancel())
            try:
                await self._forward(scope, body, send)
            except asyncio.CancelledError:
                if not gone.done() or gone.cancelled():
                    raise  # cancelled from elsewhere (shutdown), not by the client leaving
            finally:
                gone.cancel()

    # ---- choosing and trying backends ----------------------------------------------------------

    async def _prefix_keys(self, body: bytes) -> list[int]:
        """The prompt's block keys; off the event loop for a large body."""

        def keys() -> list[int]:
            return block_keys(prompt_text(_parse(body)), self.block_chars)

        return await asyncio.to_thread(keys) if len(body) > OFF_LOOP_BYTES else keys()

    async def _forward(self, scope: Scope, body: bytes, send: Send) -> None:
        keys = await self._prefix_keys(body) if scope["method"] == "POST" else []
        candidates = self.pool.candidates(self.prefix.size)
        if not candidates:
            await _respond(send, *_json(503, "No backend is available.", "no_backend"), retry_after=True)
            return
        matches = self.prefix.match(keys, (c.url for c in candidates)) if keys else {}
        ranked = rank(candidates, matches, len(keys), self.weights, self._rng)[: self.max_attempts]
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope["headers"]
            if name.lower() not in _HOP_BY_HOP
        ]
        target = scope["path"] + (
            f"?{scope['query_string'].decode('latin-1')}" if scope["query_string"] else ""
        )
        assert self.session is not None, "the router's lifespan opens the session"
        for attempt, choice in enumerate(ranked):
            last = attempt == len(ranked) - 1
            backend = self.pool.backends.get(choice.url)
            if backend is None:  # left the pool since ranking
                continue
            backend.in_flight += 1
            try:
                try:
                    response = await self.session.request(
                        scope["method"],
                        choice.url + target,
                        data=body,
                        headers=headers,
                        timeout=self._timeout,
                    )
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    logger.warning("backend %s unreachable: %s", choice.url, type(exc).__name__)
                    self.pool.mark_unreachable(choice.url)
                    self.metrics.error(choice.url, "connect")
                    if not last:
                        self.metrics.retried("connect")
                    continue
                async with response:
                    if response.status in _RETRY_STATUSES:
                        self.metrics.error(choice.url, "refused")
                        if not last:
                            self.metrics.retried(_RETRY_STATUSES[response.status])
                            continue
                    self.metrics.decided(choice.reason)
                    self.metrics.sent(choice.url)
                    if keys and response.status < 400:
                        self.prefix.record(choice.url, keys)
                    await self._relay(response, send, choice.url)
                    return
            finally:
                backend.in_flight -= 1
        await _respond(
            send, *_json(502, "No backend could be reached.", "backend_unreachable"), retry_after=True
        )

    async def _relay(self, response: aiohttp.ClientResponse, send: Send, url: str) -> None:
        headers = [
            (name.lower(), value)
            for name, value in response.raw_headers
            if name.lower() not in _RESPONSE_DROP
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except _BROKEN as exc:
            logger.warning("backend %s broke off an answer: %s", url, type(exc).__name__)
            self.metrics.error(url, "stream_broken")
            self.pool.mark_unreachable(url)
            if not streaming:
                raise  # a half-sent JSON body cannot be mended: the connection is closed
            _, error = _json(
                502, "The backend serving this stream went away; retry the request.", "backend_lost"
            )
            await send(
                {"type": "http.response.body", "body": b"data: " + error + b"\n\n", "more_body": False}
            )
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# Bodies larger than this are parsed and hashed on a worker thread, as the server does with its
# bodies: a 32 MiB prompt must not stall every other request's proxying while json.loads runs.
OFF_LOOP_BYTES = 64 << 10


def _parse(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}  # the backend answers 400 with the reason; the router only loses affinity
    return parsed if isinstance(parsed, dict) else {}


class _ClientGone(Exception):
    """The client disconnected before its request was complete."""


async def _read_body(receive: Receive) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(
    send: Send, status: int, body: bytes, content_type: bytes = b"application/json", retry_after: bool = False
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
