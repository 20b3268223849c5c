"""The in-memory retry queue: backoff, one retry per object, and nothing outliving `close`."""

from __future__ import annotations

import asyncio

from kvasir.operator.retries import RetryQueue


def test_the_delay_doubles_up_to_its_cap() -> None:
    queue = RetryQueue(2.0, 30.0)
    assert [queue.delay(n) for n in range(6)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_fresh_outcome_replaces_the_pending_retry() -> None:
    async def scenario() -> list[str]:
        queue = RetryQueue(0.01, 0.01)
        ran: list[str] = []

        async def attempt(label: str) -> bool:
            ran.append(label)
            return False

        queue.record(("ns", "a"), True, lambda: attempt("old"))
        queue.record(("ns", "a"), True, lambda: attempt("new"))
        while not ran:
            await asyncio.sleep(0.01)
        await queue.close()
        return ran

    assert asyncio.run(scenario()) == ["new"]


def test_close_cancels_a_running_retry_and_schedules_no_more() -> None:
    """A retry mid-reconcile when the kopf loop stops must not schedule another on a closing loop."""

    async def scenario() -> tuple[bool, int]:
        queue = RetryQueue(0.0, 0.0)
        started, release = asyncio.Event(), asyncio.Event()
        calls = 0

        async def attempt() -> bool:
            nonlocal calls
            calls += 1
            started.set()
            await release.wait()
            return True

        queue.record(("ns", "a"), True, attempt)
        await started.wait()
        await queue.close()
        queue.record(("ns", "b"), True, attempt)  # an outcome arriving after close
        await asyncio.sleep(0.05)
        return not queue._pending and not queue._running, calls

    assert asyncio.run(scenario()) == (True, 1)
