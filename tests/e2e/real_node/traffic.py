"""Steady chat traffic for the real-node tests: clients that send one short request after another
to a URL until stopped, and keep every outcome, so a test can say how many requests a scale-out,
a rollout or a deletion lost (any answer other than 200, or no answer)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx

MODEL = "smollm2"
REQUEST_TIMEOUT = 120.0  # seconds; a request on 2 shared cores beside a model load can be slow


def chat_body(max_tokens: int = 8, ignore_eos: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,  # with it, exactly max_tokens tokens: a request of known length
    }


def chat(
    url: str, max_tokens: int = 8, timeout: float = REQUEST_TIMEOUT, ignore_eos: bool = False
) -> httpx.Response:
    """One chat completion at `url` (an OpenAI base such as http://IP:PORT), on a new connection."""
    with httpx.Client(timeout=timeout) as client:
        return client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens, ignore_eos))


@dataclass
class Outcome:
    started: float  # time.monotonic()
    seconds: float
    status: int | None  # None: no HTTP answer
    error: str = ""
    retry_after: str | None = None  # the Retry-After header of a refusal


@dataclass
class SteadyLoad:
    """`clients` threads, each sending one request after the other to `url`. By default every
    request opens a new connection (`Connection: close`); with `keep_alive` each client keeps its
    connection open between requests, as HTTP client libraries do (kube-proxy then keeps sending
    it to the pod it first chose, even after that pod has left the Service)."""

    url: str
    clients: int = 2
    max_tokens: int = 8
    keep_alive: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> SteadyLoad:
        for _ in range(self.clients):
            thread = threading.Thread(target=self._run, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_TIMEOUT + 10)

    def _run(self) -> None:
        headers = {} if self.keep_alive else {"Connection": "close"}
        with httpx.Client(timeout=REQUEST_TIMEOUT, headers=headers) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    response = client.post(f"{self.url}/v1/chat/completions", json=chat_body(self.max_tokens))
                    outcome = Outcome(started, time.monotonic() - started, response.status_code)
                    if response.status_code != 200:
                        outcome.error = response.text[:300]
                        outcome.retry_after = response.headers.get("retry-after")
                except httpx.HTTPError as error:
                    outcome = Outcome(
                        started, time.monotonic() - started, None, f"{type(error).__name__}: {error}"
                    )
                with self._lock:
                    self.outcomes.append(outcome)

    def answered(self) -> int:
        with self._lock:
            return sum(1 for outcome in self.outcomes if outcome.status == 200)

    def lost(self) -> list[Outcome]:
        with self._lock:
            return [outcome for outcome in self.outcomes if outcome.status != 200]

    def wait_answered(self, count: int, timeout: float) -> None:
        """Until `count` requests were answered since the start (TimeoutError with the losses)."""
        deadline = time.monotonic() + timeout
        while self.answered() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.answered()} of {count} requests answered; lost: {self.lost()[:5]}")
            time.sleep(0.5)
