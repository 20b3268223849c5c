"""The server's phases (loading, ready, draining), admission with a bounded queue, and graceful drain.

Admission counts sequences (a request with n choices over p prompts is n * p of them) from the
moment a request is let in until its response is fully sent. At most `--max-num-seqs` run; the
rest wait in the engine's queue, and at most `--max-queue-len` may wait: past that a request gets
429 with Retry-After. So memory is bounded whatever the load. Everything here runs on the event
loop; only `started` (a threading.Event) is meant for other threads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import Callable
from contextlib import suppress

from kvasir.runtime.server.errors import APIError

logger = logging.getLogger(__name__)

# After the drain timeout the remaining requests are aborted; their streams then end at once.
_ABORT_GRACE_SECONDS = 5.0


class Phase(enum.Enum):
    LOADING = "loading"  # the model is loading or warming up
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: no new requests, in-flight ones finish
    FAILED = "failed"  # the model could not be loaded


class Ticket:
    """An admitted request's hold on capacity; `release()` (idempotent) gives it back."""

    def __init__(self, lifecycle: Lifecycle, request_id: str, num_seqs: int) -> None:
        self._lifecycle = lifecycle
        self.request_id = request_id
        self.num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lifecycle._release(self)


class Lifecycle:
    """Phase, in-flight accounting and the drain; `on_reject(reason)` counts turned-away requests."""

    def __init__(
        self,
        *,
        max_running: int,
        max_queue_len: int,
        retry_after: int,
        on_reject: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.capacity = max_running + max_queue_len
        self.retry_after = retry_after
        self.phase = Phase.LOADING
        self.started = threading.Event()  # set once loading has ended (ready or failed)
        self._on_reject = on_reject
        self._in_flight = 0
        self._aborts: dict[str, Callable[[], None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- phases --------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not yet fully answered."""
        return self._in_flight

    def set_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
        self.started.set()

    def set_failed(self) -> None:
        self.phase = Phase.FAILED
        self.started.set()

    def begin_drain(self) -> None:
        """Turn /ready false and refuse new requests; in-flight ones go on."""
        if self.phase is not Phase.DRAINING:
            logger.info("draining: %d sequences in flight", self._in_flight)
        self.phase = Phase.DRAINING

    # ---- admission -----------------------------------------------------------------------------

    def check_open(self, *, count: bool = True) -> None:
        """Raise 503 unless the server takes requests now. `count=False` for utility calls
        (/tokenize, /detokenize): they are refused the same way but are not generation requests,
        so they stay out of the rejected-requests metric the availability SLO divides by."""
        if self.phase is Phase.READY:
            return
        reason = {Phase.LOADING: "loading", Phase.DRAINING: "draining"}.get(self.phase, "loading")
        if count:
            self._on_reject(reason)
        message = {
            Phase.LOADING: "The model is still loading; retry shortly.",
            Phase.DRAINING: "The server is shutting down; send the request to another replica.",
            Phase.FAILED: "The model failed to load.",
        }[self.phase]
        raise APIError(503, message, code=self.phase.value, headers={"Retry-After": str(self.retry_after)})

    def admit(self, request_id: str, num_seqs: int, abort: Callable[[], None]) -> Ticket:
        """Hold capacity for `num_seqs` sequences, or raise 503 (not open), 400 (never fits) or 429 (full)."""
        self.precheck(num_seqs)
        self._in_flight += num_seqs
        self._aborts[request_id] = abort
        self._idle.clear()
        return Ticket(self, request_id, num_seqs)

    def precheck(self, num_seqs: int) -> None:
        """`admit`'s refusals without holding anything: called before the expensive work a request
        needs (tokenizing, rendering), so a full server answers 429 at once instead of after it."""
        self.check_open()
        if num_seqs > self.capacity:
            raise APIError(
                400,
                f"The request asks for {num_seqs} sequences (n times the number of prompts); this server "
                f"holds at most {self.capacity} at once.",
                param="n",
                code="too_many_sequences",
            )
        if self._in_flight + num_seqs > self.capacity:
            self._on_reject("queue_full")
            raise APIError(
                429,
                f"The server is at capacity ({self._in_flight} of {self.capacity} sequences running or "
                "queued); retry later.",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after)},
            )

    def _release(self, ticket: Ticket) -> None:
        self._in_flight -= ticket.num_seqs
        self._aborts.pop(ticket.request_id, None)
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    # ---- drain ---------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Stop admitting and let in-flight requests finish; after `timeout` s abort the rest.

        Returns True when every request finished on its own."""
        self.begin_drain()
        try:
            await asyncio.wait_for(self.wait_idle(), timeout)
            logger.info("drained: every in-flight request finished")
            return True
        except asyncio.TimeoutError:
            logger.warning("drain timeout (%.1fs): aborting %d requests", timeout, len(self._aborts))
        for abort in list(self._aborts.values()):
            abort()
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wait_idle(), _ABORT_GRACE_SECONDS)
        return False
