"""The router's ASGI app: OpenAI-compatible requests proxied to the best backend, byte for byte.

A request is checked before its body is read: its path must be one of the routes the router
forwards, exactly (no dot segment, no encoded slash, dot or backslash: nothing normalises into
another backend path), and, with `--api-key`, it must carry the key. Its body is then read whole
within the same bounds as `kvasir serve` (`body_limit`: one body's cap, and a bound on all bodies
held at once, past which the answer is 429), and its shape checked on the raw bytes before it is
parsed (`json_bounds`: depth, containers, values, strings, members), on a worker thread when it is
large. It is small next to its answer, and a retry needs it again; the answer is never buffered:
each chunk the backend sends is written to the client as it arrives.

Until the first byte of an answer is written, a backend that answers 429 or 503 (full, draining),
cannot be reached, answers something that is not HTTP, or does not start its answer within
`--first-byte-timeout`, is replaced by the next best one (the last two also mark it unreachable
until a scrape succeeds); after it, nothing is retried (the client could see an answer twice). A
backend that breaks off mid-answer gets the client an SSE error event (a stream) or a closed
connection (a JSON body): never a hang. A client that disconnects closes the connection to the
backend, which aborts the request there. No error answer carries a traceback."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import re
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from yarl import URL

from kvasir.router.backends import BackendPool
from kvasir.router.held_stream import HeldStream
from kvasir.router.hold import RETRY_AFTER_SECONDS, HoldQueue
from kvasir.router.lifecycle import RouterLifecycle
from kvasir.router.lora import Aliases, resolve
from kvasir.router.metrics import RouterMetrics
from kvasir.router.prefix import PrefixIndex, block_keys, prompt_text
from kvasir.router.scorer import Weights, rank, serves
from kvasir.runtime.server.body_limit import BodyLimits, send_error
from kvasir.runtime.server.json_bounds import ShapeError, check_shape
from kvasir.runtime.server.printable import printable

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 32 << 20  # as `kvasir serve`'s default --max-request-bytes
MAX_BUFFERED_BYTES = 256 << 20  # as `kvasir serve`'s default --max-buffered-request-bytes
# Bodies larger than this are shape-checked, parsed and hashed on a worker thread, as the server
# does with its bodies: a 32 MiB prompt must not stall every other request's proxying.
OFF_LOOP_BYTES = 64 << 10
PARSE_THREADS = 2  # bodies parsed at once (each within the shape bounds: tens of MB at most)

# The backend routes the router forwards, exactly (and /v1/models/<model id>): nothing else of a
# backend (its /metrics, /docs, /openapi.json, ...) is reachable through the router.
PROXIED_PATHS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/version"}
)
_MODEL_PATH = "/v1/models/"
# Escapes that decode to a path separator, a dot, a backslash, a percent sign or NUL: a path
# holding one could mean another path to whoever decodes it next.
_DANGEROUS_ESCAPE = re.compile(rb"%(?:2[eEfF]|5[cC]|25|00)")

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
_HOLD_RETRY_AFTER = (b"retry-after", str(RETRY_AFTER_SECONDS).encode())
CLIENT_EOF = "kvasir.client_eof"  # the scope key of `client_eof`
# How a hold that ended without a backend is answered: outcome -> (code, message).
_HOLD_REFUSALS = {
    "timed_out": (
        "hold_timeout",
        "No backend became ready within {timeout:g} s (--hold-timeout); retry later.",
    ),
    "draining": ("draining", "The router is shutting down and no backend is ready; retry."),
    # Only a plain request's closed input ends its wait this way; if the client only half-closed
    # and still reads, this is what it reads (and the server logs no answer-less request).
    "client_gone": (
        "client_closed",
        "The request was dropped while it waited for a backend: the client closed its side of the connection.",
    ),
}
# What a backend's answer can break off with once it has started.
_BROKEN = (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError)
# When every backend failed, the last failure's answer: (status, code, message).
_FAILED = {
    "connect": (502, "backend_unreachable", "No backend could be reached."),
    "bad_response": (502, "bad_backend_response", "No backend gave a valid HTTP answer."),
    "timeout": (504, "backend_timeout", "No backend started its answer within --first-byte-timeout."),
}


def _json(status: int, message: str, code: str, kind: str = "server_error") -> tuple[int, bytes]:
    error = {"message": message, "type": kind, "param": None, "code": code}
    return status, json.dumps({"error": error}).encode()


def proxied_target(scope: Scope) -> tuple[str | None, tuple[int, str, str] | None]:
    """The path and query to send the backend (as the client encoded them), or the refusal
    (status, code, message): 400 for a path with a dot segment, a backslash or an escape of
    `/ . \\ %` or NUL (checked on the raw path and on the decoded one), 404 for a path that is not
    exactly one of the proxied routes (an empty segment, a trailing slash included)."""
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    path: str = scope["path"]
    if (
        not raw.startswith(b"/")
        or b"\\" in raw
        or _DANGEROUS_ESCAPE.search(raw)
        or "\\" in path
        or any(segment in (".", "..") for segment in path.split("/"))
    ):
        shown = printable(raw.decode("latin-1"), 200)
        why = "dot segments and escaped slashes, dots and backslashes are refused"
        return None, (400, "invalid_path", f"{shown} is not a path the router forwards ({why})")
    model = path[len(_MODEL_PATH) :] if path.startswith(_MODEL_PATH) else None
    if path not in PROXIED_PATHS and not (model and "" not in model.split("/")):
        return None, (404, "not_found", f"{printable(path, 200)} is not a route of this router")
    query: bytes = scope.get("query_string") or b""
    target = raw.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
    return target, None


def authorized(headers: list[tuple[bytes, bytes]], key: str) -> bool:
    """Whether `Authorization: Bearer <key>` is among `headers` (compared in constant time), read as
    `kvasir serve` reads it."""
    value = next((v for name, v in headers if name.lower() == b"authorization"), b"")
    scheme, _, given = value.partition(b" ")
    if scheme.lower() != b"bearer":
        given = b""
    return hmac.compare_digest(given, key.encode())


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
        first_byte_timeout: float = 600.0,
        api_key: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
        aliases: Aliases | None = None,
        hold: HoldQueue | None = None,
        heartbeat_interval: float = 5.0,
    ) -> None:
        self.pool = pool
        self.prefix = prefix
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.weights = weights
        self.block_chars = block_chars
        self.max_attempts = max_attempts
        self.first_byte_timeout = first_byte_timeout
        self.api_key = api_key
        self.aliases = dict(aliases or {})
        self.hold = hold  # None: no holding (503 at once while no backend is available)
        self.heartbeat_interval = heartbeat_interval
        self.bodies = BodyLimits(max_body_bytes, max_buffered_bytes, busy_status=429, who="router")
        self.session: aiohttp.ClientSession | None = None  # opened by the app's lifespan
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=None)
        self._rng = random.Random()
        self._parser = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="kvasir-router-parse")

    def close(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    # ---- the ASGI entry point ------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        started = False

        async def tracked(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._route(scope, receive, tracked)
        except Exception as exc:  # a bug: one log line, and a 500 without a traceback
            logger.error(
                "internal error on %s %s: %s: %s",
                scope.get("method"),
                printable(scope.get("path", ""), 200),
                type(exc).__name__,
                printable(str(exc), 300),
            )
            logger.debug("the internal error's traceback", exc_info=True)
            if not started:
                await _respond(send, *_json(500, "Internal router error.", "internal_error"))
            # Otherwise returning with the answer incomplete makes the server close the connection.

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            # While it holds requests for a backend, the router itself is ready: at zero replicas
            # it must stay in its Service, or the request that would wake the model never arrives.
            holding = self.hold is not None and self.hold.max_held > 0
            ready = self.lifecycle.accepting and (holding or bool(self.pool.backends))
            await _respond(send, 200 if ready else 503, b'{"ready":%s}' % (b"true" if ready else b"false"))
        elif path == "/metrics" and method == "GET":
            await _respond(send, 200, self.metrics.render(), self.metrics.content_type.encode())
        else:
            target, refusal = proxied_target(scope)
            if refusal is not None:
                status, code, message = refusal
                await send_error(send, status, message, code)
                return
            assert target is not None
            await self._proxy(scope, target, receive, send)

    async def _proxy(self, scope: Scope, target: str, receive: Receive, send: Send) -> None:
        if not self.lifecycle.accepting:
            await _respond(send, *_json(503, "The router is shutting down.", "draining"), retry_after=True)
            return
        if self.api_key is not None and not authorized(scope["headers"], self.api_key):
            given = any(name.lower() == b"authorization" for name, _ in scope["headers"])
            message = (
                "Incorrect API key provided." if given else "Missing API key (Authorization: Bearer ...)"
            )
            await send_error(
                send, 401, message, "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")]
            )
            return
        async with self.bodies.hold(scope, receive, send) as body:
            if body is None:  # refused (answered) or the client left
                return
            try:
                keys, model, body, stream = await self._inspect(body)
            except ShapeError as error:
                await send_error(send, 400, error.message, "request_too_complex", param=error.param)
                return
            with self.lifecycle.hold():
                # One watcher task per request: when the client leaves, it cancels this one, which
                # closes the backend connection (and so aborts the request there).
                this = asyncio.current_task()
                assert this is not None
                gone = asyncio.ensure_future(_disconnected(receive))
                gone.add_done_callback(lambda watcher: watcher.cancelled() or this.cancel())
                try:
                    if self.hold is not None and self.hold.should_hold(self.pool.any_ready()):
                        await self._held(self.hold, scope, target, body, keys, send, model, stream)
                    else:
                        await self._forward(scope, target, body, keys, send, model)
                except asyncio.CancelledError:
                    if not gone.done() or gone.cancelled():
                        raise  # cancelled from elsewhere (shutdown), not by the client leaving
                finally:
                    gone.cancel()

    # ---- choosing and trying backends ----------------------------------------------------------

    async def _inspect(self, body: bytes) -> tuple[list[int], str | None, bytes, bool]:
        """The prompt's block keys, the `model` asked for, the body to send and whether the answer
        is a stream, once the body's shape is within bounds (ShapeError otherwise); off the event
        loop for a large body. A request for a LoRA alias is rewritten into one for the adapter
        drawn by weight."""

        def inspect() -> tuple[list[int], str | None, bytes, bool]:
            if not body:
                return [], None, body, False
            check_shape(body)
            parsed = _parse(body)
            keys = block_keys(prompt_text(parsed), self.block_chars)
            stream = parsed.get("stream") is True
            model = parsed.get("model")
            if not isinstance(model, str):
                return keys, None, body, stream
            chosen = resolve(model, self.aliases, self._rng)
            if chosen == model:
                return keys, model, body, stream
            return keys, chosen, json.dumps({**parsed, "model": chosen}).encode(), stream

        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.get_running_loop().run_in_executor(self._parser, inspect)
        return inspect()

    async def _held(
        self,
        hold: HoldQueue,
        scope: Scope,
        target: str,
        body: bytes,
        keys: list[int],
        send: Send,
        model: str | None,
        stream: bool,
    ) -> None:
        """Wait in the hold queue for a ready backend, then take the normal path; 503 with
        Retry-After when the queue is full or the wait passes --hold-timeout."""
        place = hold.join()
        if place is None:
            message = f"No backend is ready and {hold.max_held} requests already wait for one (--max-held-requests)."
            await send_error(send, 503, message, "hold_queue_full", headers=[_HOLD_RETRY_AFTER])
            return
        answer = HeldStream(send, self.heartbeat_interval) if stream else None
        try:
            if answer is not None:
                await answer.open()
                # The heartbeats' writes notice a client that closed its socket.
                outcome = await hold.wait(place)
            else:
                # Nothing is written while it waits: its closed (or half-closed) socket is the sign.
                outcome = await hold.wait(place, client_eof(scope))
            if outcome in _HOLD_REFUSALS:
                code, message = _HOLD_REFUSALS[outcome]
                message = message.format(timeout=hold.timeout)
                if answer is not None:
                    await answer.fail(503, message, code)
                else:
                    await send_error(send, 503, message, code, headers=[_HOLD_RETRY_AFTER])
            elif outcome == "released":
                await self._forward(
                    scope, target, body, keys, answer.send if answer else send, model, place.dispatched
                )
        finally:
            place.dispatched.set()
            if hold.leave(place):  # its wait never began: the client left while its stream opened
                self.metrics.hold_ended("client_gone")
            if answer is not None:
                await answer.close()

    async def _forward(
        self,
        scope: Scope,
        target: str,
        body: bytes,
        keys: list[int],
        send: Send,
        model: str | None = None,
        dispatched: asyncio.Event | None = None,
    ) -> None:
        candidates = self.pool.candidates(self.prefix.size)
        if not candidates:
            await _respond(send, *_json(503, "No backend is available.", "no_backend"), retry_after=True)
            return
        matches = self.prefix.match(keys, (c.url for c in candidates)) if keys else {}
        # `model` is scored as an adapter when some backend says it serves one by that name.
        adapter = model if model and any(serves(c, model) for c in candidates) else None
        ranked = rank(candidates, matches, len(keys), self.weights, self._rng, adapter)[: self.max_attempts]
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in scope["headers"]
            if name.lower() not in _HOP_BY_HOP
        ]
        assert self.session is not None, "the router's lifespan opens the session"
        failure = "connect"
        for attempt, choice in enumerate(ranked):
            last = attempt == len(ranked) - 1
            backend = self.pool.backends.get(choice.url)
            if backend is None:  # left the pool since ranking
                continue
            backend.in_flight += 1
            try:
                try:
                    # The path as the client encoded it (checked above): nothing re-encodes or
                    # normalises it on the way.
                    request = self.session.request(
                        scope["method"],
                        URL(choice.url + target, encoded=True),
                        data=body,
                        headers=headers,
                        timeout=self._timeout,
                        allow_redirects=False,  # a redirect is the client's to follow
                        # A held request: the hold releases the next one once this one is sent.
                        trace_request_ctx=(
                            {"dispatched": dispatched, "has_body": bool(body)}
                            if dispatched is not None
                            else None
                        ),
                    )
                    response = await _within(request, self.first_byte_timeout)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    failure = _failure_kind(exc)
                    logger.warning(
                        "backend %s failed before answering (%s): %s",
                        choice.url,
                        failure,
                        printable(str(exc) or type(exc).__name__, 200),
                    )
                    self.pool.mark_unreachable(choice.url)
                    self.metrics.error(backend.label, failure)
                    if not last:
                        self.metrics.retried(failure)
                    continue
                async with response:
                    if response.status in _RETRY_STATUSES:
                        self.metrics.error(backend.label, "refused")
                        if not last:
                            self.metrics.retried(_RETRY_STATUSES[response.status])
                            continue
                    self.metrics.decided(choice.reason)
                    self.metrics.sent(backend.label)
                    if keys and response.status < 400:
                        self.prefix.record(choice.url, keys)
                    await self._relay(response, send, choice.url, backend.label)
                    return
            finally:
                backend.in_flight -= 1
        status, code, message = _FAILED[failure]
        await _respond(send, *_json(status, message, code), retry_after=True)

    async def _relay(self, response: aiohttp.ClientResponse, send: Send, url: str, label: str) -> None:
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
            self.metrics.error(label, "stream_broken")
            self.pool.mark_unreachable(url)
            if not streaming:
                # A half-sent JSON body cannot be mended: returning with the answer incomplete
                # makes the server close the client's connection.
                return
            _, error = _json(
                502, "The backend serving this stream went away; retry the request.", "backend_lost"
            )
            await send(
                {"type": "http.response.body", "body": b"data: " + error + b"\n\n", "more_body": False}
            )
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _within(request: Awaitable[aiohttp.ClientResponse], timeout: float) -> aiohttp.ClientResponse:
    """The backend's answer once its head has arrived; asyncio.TimeoutError after `timeout` s.

    In this task, not a new one as `wait_for` makes (on 3.10): the answer's first body bytes are
    then read as soon as its head is, as without a timeout."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await request
    return await asyncio.wait_for(request, timeout)


def _failure_kind(exc: BaseException) -> str:
    """connect (no connection, its timeout, or closed before any answer), bad_response (an answer
    that is not HTTP: garbage, a bad status line, oversized headers), timeout (no answer within
    --first-byte-timeout)."""
    if isinstance(exc, aiohttp.ClientConnectionError):  # aiohttp's connect timeout included
        return "connect"
    if isinstance(exc, aiohttp.ClientError):
        return "bad_response"
    return "timeout"


def _parse(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return {}  # the backend answers 400 with the reason; the router only loses affinity
    return parsed if isinstance(parsed, dict) else {}


def client_eof(scope: Scope) -> asyncio.Event:
    """Set when the client closed its sending side after a complete request (the router's HTTP
    protocol sets it, server.py); while nothing has been written, a half-closed and a closed
    connection look alike, and a held request takes either for a client that left."""
    event: asyncio.Event = scope.setdefault(CLIENT_EOF, asyncio.Event())
    return event


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
