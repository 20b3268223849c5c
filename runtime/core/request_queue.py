"""The scheduler's waiting queue: FCFS (a deque) or priority (a heap), with O(1) lazy removal.

Aborting a waiting request must not cost O(waiting): `discard` only marks it, and the entry is
dropped when it reaches the front. Peeking and popping stay O(1) amortized (O(log n) for the heap).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque

from kvasir.runtime.config import SCHEDULING_POLICIES
from kvasir.runtime.core.request import Request


class RequestQueue(ABC):
    """Requests waiting for admission, in the order the policy admits them."""

    def __init__(self) -> None:
        # Discarded entries still in the container, by identity: a request id can be reused
        # after its request finished, while the old entry has not reached the front yet.
        self._discarded: set[int] = set()

    @abstractmethod
    def push(self, request: Request) -> None:
        """Enqueue a new arrival."""

    @abstractmethod
    def push_front(self, request: Request) -> None:
        """Re-enqueue a preempted request ahead of the requests that arrived after it."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The next request to admit, or None if none waits."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the request `peek` returns."""

    def discard(self, request: Request) -> None:
        """Forget a request that is in the queue (aborted while waiting), in O(1)."""
        self._discarded.add(id(request))

    @abstractmethod
    def __len__(self) -> int:
        """Live requests waiting (discarded ones excluded)."""

    def _is_discarded(self, request: Request) -> bool:
        key = id(request)
        if key in self._discarded:
            self._discarded.remove(key)
            return True
        return False


class FcfsQueue(RequestQueue):
    """First come, first served; preempted requests go back to the front."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        while self._queue and self._is_discarded(self._queue[0]):
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue) - len(self._discarded)


class PriorityQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival; preemption keeps a request's place."""

    def __init__(self) -> None:
        super().__init__()
        # The counter breaks ties without ever comparing Request objects.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        entry = (request.priority, request.times.arrival, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def push_front(self, request: Request) -> None:
        # Its (priority, arrival) key already puts it ahead of everything that came after it.
        self.push(request)

    def peek(self) -> Request | None:
        while self._heap and self._is_discarded(self._heap[0][3]):
            heapq.heappop(self._heap)
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        if self.peek() is None:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def __len__(self) -> int:
        return len(self._heap) - len(self._discarded)


# The queue of each scheduling policy that config.SCHEDULING_POLICIES names.
QUEUE_BY_POLICY: dict[str, type[RequestQueue]] = {"fcfs": FcfsQueue, "priority": PriorityQueue}
if tuple(QUEUE_BY_POLICY) != SCHEDULING_POLICIES:
    raise ImportError(
        f"request queues {tuple(QUEUE_BY_POLICY)} do not match the policies {SCHEDULING_POLICIES}"
    )
