"""Reconciles retried in memory, with backoff, for problems no watch will announce.

A missing Secret (Secrets are read by name, never watched) or an API fault may pass by itself, so
the LLMDeployment is reconciled again: 2 s doubling to 30 s. kopf's own retries (a
`TemporaryError` from a handler) keep their state in annotations on the object, which cost two
writes to it per retry, forever, while it waited; here the state is a counter in this process, and
a retry that finds nothing changed writes nothing. Problems that a watched object will announce
(a pod that cannot be scheduled: its next event wakes the reconcile) and an invalid spec (fixed by
a spec change, an event of its own; the resync catches any other path) are not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)
# Problems on things no watch of the operator's sees: a Secret, the API server itself, an object
# of someone else's holding a child's name, an adapter a pod failed to load.
UNWATCHED_REASONS = frozenset({"SecretNotFound", "ApiError", "ChildConflict", "AdapterLoadFailed"})
# A reconcile to retry: returns whether the object still waits on something a retry may fix.
Attempt = Callable[[], Awaitable[bool]]


def waits_unwatched(reason: str | None, retryable: bool) -> bool:
    """Whether a reconcile's outcome needs a timed retry: a problem that may pass by itself and
    that no watch will announce."""
    return retryable and reason in UNWATCHED_REASONS


class RetryQueue:
    """At most one pending retry per object; a fresh outcome replaces it."""

    def __init__(self, base_seconds: float, max_seconds: float) -> None:
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self._attempts: dict[Key, int] = {}
        self._pending: dict[Key, asyncio.Task[None]] = {}  # waiting out their delay
        self._running: set[asyncio.Task[None]] = set()  # reconciling now: no longer replaceable
        self._closed = False

    def delay(self, attempt: int) -> float:
        """base * 2^attempt, capped."""
        return float(min(self.base_seconds * 2 ** min(attempt, 30), self.max_seconds))

    def record(self, key: Key, waiting: bool, attempt: Attempt) -> None:
        """After a reconcile of `key`: retry `attempt` later if it still waits, else forget `key`."""
        if self._closed:  # the kopf loop is stopping: a retry would outlive its event loop
            return
        self._cancel(key)
        if not waiting:
            self._attempts.pop(key, None)
            return
        count = self._attempts.get(key, 0)
        self._attempts[key] = count + 1
        self._pending[key] = asyncio.ensure_future(self._later(key, self.delay(count), attempt))

    def forget(self, key: Key) -> None:
        """The object is gone: no retry for it."""
        self._cancel(key)
        self._attempts.pop(key, None)

    async def close(self) -> None:
        """Cancel every retry, waiting or running; later outcomes schedule none."""
        self._closed = True
        tasks = [*self._pending.values(), *self._running]
        self._pending.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)

    def _cancel(self, key: Key) -> None:
        task = self._pending.pop(key, None)
        if task is not None:
            task.cancel()

    async def _later(self, key: Key, delay: float, attempt: Attempt) -> None:
        await asyncio.sleep(delay)
        # No longer cancellable by a fresh outcome: a reconcile is never cut off halfway (only
        # `close` cuts it, when the loop stops).
        task = asyncio.current_task()
        assert task is not None
        if self._pending.get(key) is task:
            del self._pending[key]
        self._running.add(task)
        try:
            waiting = await attempt()
        except Exception:  # a retry must never kill the queue; the next event reconciles again
            logger.exception("retrying the reconcile of %s/%s failed", *key)
            waiting = True
        finally:
            self._running.discard(task)
        self.record(key, waiting, attempt)
