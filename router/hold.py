"""The hold queue: requests that arrive while no backend is ready wait here, in arrival order,
instead of failing (scale from zero).

Bounded twice: at most `--max-held-requests` requests (past it, 503 at once), and each body stays
counted in `--max-buffered-request-bytes` while it waits (it is held by the same `BodyLimits`
block as any request). A request waits at most `--hold-timeout` seconds from its arrival (then
503). When a backend becomes ready the queue is released in order, one request at a time: each is
let go once the previous one has gone out to its backend (`dispatched`, set by an aiohttp trace),
so the backend admits them in the order they came. A released request then takes the normal path
(scoring, retries, relaying)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp

from kvasir.router.metrics import RouterMetrics

# Longest wait for one released request to reach its backend before the next is released. Long
# enough for a loaded event loop to open a connection; once one wait runs out, the rest of that
# release goes at once, so a backend that does not accept connections delays the queue by this once.
DISPATCH_GAP = 1.0
RETRY_AFTER_SECONDS = 5  # a 503 from the hold: a replica is starting, so not at once


@dataclass
class Held:
    """One held request's place in the queue."""

    joined: float  # time.monotonic() at arrival
    released: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    dispatched: asyncio.Event = field(default_factory=asyncio.Event)  # its head reached a backend


class HoldQueue:
    """A bounded FIFO of held requests; one event loop, so no lock."""

    def __init__(self, max_held: int, timeout: float, metrics: RouterMetrics) -> None:
        self.max_held = max_held
        self.timeout = timeout
        self._metrics = metrics
        self._queue: deque[Held] = deque()
        self._changed = asyncio.Event()  # set whenever a request joins or leaves
        self._draining = asyncio.Event()  # the router is shutting down: every wait ends

    def __len__(self) -> int:
        return len(self._queue)

    def should_hold(self, backend_ready: bool) -> bool:
        """Whether a new request waits here: when no backend is ready, and also while earlier
        requests still wait to be released (so a new one does not overtake them), unless holding is
        off (`max_held` 0)."""
        return self.max_held > 0 and (not backend_ready or 0 < len(self._queue) < self.max_held)

    def join(self) -> Held | None:
        """A place at the end of the queue, or None when it is full (counted: rejected_full)."""
        if len(self._queue) >= self.max_held:
            self._metrics.hold_ended("rejected_full")
            return None
        held = Held(time.monotonic())
        self._queue.append(held)
        self._update()
        return held

    async def wait(self, held: Held, client_left: asyncio.Event | None = None) -> str:
        """Until `held` is released (`released`), `--hold-timeout` has passed since it arrived
        (`timed_out`), `client_left` is set (`client_gone`) or the router drains (`draining`); a
        cancelled wait (the client disconnected) is counted as `client_gone` too. The outcome is
        counted and returned."""
        draining = asyncio.ensure_future(self._draining.wait())
        waiters: set[asyncio.Future[Any]] = {held.released, draining}
        left = asyncio.ensure_future(client_left.wait()) if client_left is not None else None
        if left is not None:
            waiters.add(left)
        remaining = held.joined + self.timeout - time.monotonic()
        outcome = "client_gone"
        try:
            await asyncio.wait(waiters, timeout=max(remaining, 0.0), return_when=asyncio.FIRST_COMPLETED)
            # Released wins a tie: the release may have come after the timer fired, before this ran.
            if held.released.done():
                outcome = "released"
            elif draining.done():
                outcome = "draining"
            elif left is None or not left.done():
                outcome = "timed_out"
            return outcome
        finally:
            draining.cancel()
            if left is not None:
                left.cancel()
            self.leave(held)
            self._metrics.hold_ended(outcome)

    async def release(self, gap: float = DISPATCH_GAP) -> None:
        """Release every held request in arrival order (those that join meanwhile too)."""
        ordered = True
        while self._queue:
            held = self._queue.popleft()
            self._update()
            if held.released.done():
                continue
            held.released.set_result(None)
            if ordered:
                try:
                    await asyncio.wait_for(held.dispatched.wait(), gap)
                except asyncio.TimeoutError:
                    ordered = False
            else:
                await asyncio.sleep(0)  # let the released one start before the next

    def drain(self) -> None:
        """End every wait (the router is shutting down); new requests are refused before they join."""
        self._draining.set()

    async def wait_change(self, timeout: float) -> None:
        """Until a request joins or leaves, or `timeout` seconds."""
        self._changed.clear()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def leave(self, held: Held) -> bool:
        """Take `held` out of the queue; whether it was still there."""
        try:
            self._queue.remove(held)
        except ValueError:
            return False
        self._update()
        return True

    def _update(self) -> None:
        self._metrics.holding(len(self._queue))
        self._changed.set()


async def _head_sent(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    request: Mapping[str, Any] | None = context.trace_request_ctx
    if request and not request.get("has_body"):
        _dispatched(request)


async def _body_sent(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    request: Mapping[str, Any] | None = context.trace_request_ctx
    if request:
        _dispatched(request)


def _dispatched(request: Mapping[str, Any]) -> None:
    event = request.get("dispatched")
    if isinstance(event, asyncio.Event):
        event.set()


def dispatch_trace() -> aiohttp.TraceConfig:
    """The router session's trace: a request sent with
    `trace_request_ctx={"dispatched": event, "has_body": ...}` sets `event` as its body (or, without
    one, its head) is written to the backend's connection. (aiohttp calls the trace just before
    the write, in the same step: whoever waits on `event` runs after the bytes went out.)"""
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_head_sent)
    trace.on_request_chunk_sent.append(_body_sent)
    return trace
