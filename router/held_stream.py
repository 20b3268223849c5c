"""The answer to a streamed request held while no backend is ready: begun at once and kept alive.

The client gets `200` and `text/event-stream` as soon as its request is held, and an SSE comment
(`: heartbeat`) at once and then every `--heartbeat-interval` seconds until a backend starts its
answer, so proxies' and SDKs' read timeouts do not fire during a cold start (SSE clients, the
openai SDK's included, skip comments). Then the backend's events pass through as they come. Since
the status is already sent, an answer that is not a success (the backend's 400 or 429, the
router's own 502 or the hold's timeout) arrives as one SSE error event in the OpenAI shape
(`data: {"error": {...}}`, as the openai SDK raises it), and the stream ends."""

from __future__ import annotations

import asyncio
import json
from contextlib import suppress
from typing import Any

from kvasir.runtime.server.body_limit import Message, Send, error_json

HEARTBEAT = b": heartbeat\n\n"
MAX_ERROR_BYTES = 64 << 10  # of a refusal's body, turned into the error event
_HEAD = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class HeldStream:
    """Wraps the client's `send`: `open()` starts the stream; `send` is what the proxy writes the
    backend's answer (or its own refusal) with; `fail()` ends it with an error event."""

    def __init__(self, send: Send, interval: float) -> None:
        self._client = send
        self._interval = interval
        self._beating: asyncio.Task[None] | None = None
        self._status: int | None = None  # the answer's status, once it started
        self._refusal = bytearray()

    async def open(self) -> None:
        await self._client({"type": "http.response.start", "status": 200, "headers": _HEAD})
        await self._client({"type": "http.response.body", "body": HEARTBEAT, "more_body": True})
        self._beating = asyncio.create_task(self._beat())

    async def close(self) -> None:
        """Stop the heartbeats (the request is over, however it ended)."""
        if self._beating is not None:
            self._beating.cancel()
            with suppress(asyncio.CancelledError):
                await self._beating
            self._beating = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            if not 200 <= self._status < 300:
                await self.close()
            return  # the client's head went out when the request was held
        await self.close()  # from the first byte of the answer on, only the backend writes
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if self._status is not None and 200 <= self._status < 300:
            await self._client({"type": "http.response.body", "body": body, "more_body": more})
            return
        self._refusal += body[: MAX_ERROR_BYTES - len(self._refusal)]
        if not more:
            await self._client(_error_event(self._status or 502, bytes(self._refusal)))

    async def fail(self, status: int, message: str, code: str) -> None:
        await self.close()
        await self._client(
            {"type": "http.response.body", "body": b"data: " + error_json(status, message, code) + b"\n\n"}
        )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self._client({"type": "http.response.body", "body": HEARTBEAT, "more_body": True})


def _error_event(status: int, body: bytes) -> Message:
    """The refusal's own OpenAI error as an SSE event, or one naming its status."""
    event: bytes
    try:
        parsed: Any = json.loads(body)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        event = json.dumps({"error": parsed["error"]}).encode()
    else:
        event = error_json(status, f"The backend answered {status}.", "backend_error")
    return {"type": "http.response.body", "body": b"data: " + event + b"\n\n", "more_body": False}
