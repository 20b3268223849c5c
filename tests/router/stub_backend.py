"""A stand-in for `kvasir serve` on a real uvicorn server: answers the OpenAI routes with canned
chunks, exposes /metrics with settable load, and can refuse (429/503), hold a stream open, die
mid-stream or stop answering /metrics, so the router's tests can stage each case."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn

TIMEOUT = 30.0


@dataclass
class StubBackend:
    name: str
    waiting: float = 0.0
    kv_usage: float = 0.0
    refuse_with: int | None = None  # answer every generation request with this status
    chunks: int = 3  # SSE data events of a stream
    die_after: int | None = None  # break the connection after this many chunks
    metrics_hang: bool = False  # /metrics never answers
    hold: threading.Event | None = None  # a stream waits for this after its first chunk
    metrics_padding: int = 0  # bytes of comment lines added to /metrics
    adapters: tuple[str, ...] = ()  # LoRA adapters served: in /v1/models and /metrics' LoRA info
    api_key: str | None = None  # /v1/models answers 401 without `Authorization: Bearer <key>`
    requests: list[dict[str, Any]] = field(default_factory=list)
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # every request: path, headers
    metrics_served: int = 0
    ready: bool = True  # /ready answers 200, else 503 (as a loading `kvasir serve`)
    disconnected: threading.Event = field(default_factory=threading.Event)
    first_chunk_sent: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.seen.append((path, {k.decode(): v.decode() for k, v in scope["headers"]}))
        if path == "/metrics":
            if self.metrics_hang:
                await asyncio.sleep(3600)
            text = (
                f'kvasir_requests_waiting{{model_name="{self.name}"}} {self.waiting}\n'
                f'kvasir_requests_running{{model_name="{self.name}"}} 0\n'
                f'kvasir_kv_cache_usage_ratio{{model_name="{self.name}"}} {self.kv_usage}\n'
            )
            if self.adapters:
                text += (
                    'kvasir_lora_requests_info{running_lora_adapters="",waiting_lora_adapters="",'
                    f'max_lora="{len(self.adapters)}"}} 1\n'
                )
            padding = ("# " + "x" * 98 + "\n") * (self.metrics_padding // 101)
            await _send(send, 200, (padding + text).encode(), b"text/plain")
            self.metrics_served += 1
            return
        if path == "/ready":
            await _send(
                send, 200 if self.ready else 503, b'{"ready":%s}' % (b"true" if self.ready else b"false")
            )
            return
        body = await read_body(receive)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        parsed = json.loads(body) if body else {}
        self.requests.append({"path": path, "headers": headers, "body": parsed})
        if self.refuse_with is not None:
            error = {
                "error": {"message": "full", "type": "server_error", "param": None, "code": "queue_full"}
            }
            await _send(send, self.refuse_with, json.dumps(error).encode(), extra=[(b"retry-after", b"1")])
            return
        if path == "/v1/models":
            if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
                await _send(send, 401, b'{"error": {"code": "invalid_api_key"}}')
                return
            cards = [{"id": "m", "object": "model", "created": 0, "owned_by": "kvasir"}]
            cards += [{"id": name, "object": "model", "parent": "m"} for name in self.adapters]
            await _send(send, 200, json.dumps({"object": "list", "data": cards}).encode())
            return
        if not parsed.get("stream"):
            answer = _completion(self.name, path)
            await _send(send, 200, json.dumps(answer).encode())
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            for index in range(self.chunks):
                if self.die_after is not None and index == self.die_after:
                    raise ConnectionAbortedError("the stub backend dies mid-stream")
                await send(
                    {"type": "http.response.body", "body": _chunk(self.name, path, index), "more_body": True}
                )
                if index == 0:
                    self.first_chunk_sent.set()
                    if self.hold is not None:
                        while not self.hold.is_set():
                            if watcher.done():
                                return
                            await asyncio.sleep(0.01)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            watcher.cancel()

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()


async def read_body(receive: Any) -> bytes:
    """A request's whole body, from ASGI `receive`."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def _completion(name: str, path: str) -> dict[str, Any]:
    if path.endswith("chat/completions"):
        return {
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": name}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }  # fmt: skip
    return {
        "id": "c", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": name, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }  # fmt: skip


def _chunk(name: str, path: str, index: int) -> bytes:
    if path.endswith("chat/completions"):
        delta = {"index": 0, "delta": {"content": f"{name}{index} "}, "finish_reason": None}
        event = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [delta]}
    else:
        choice = {"index": 0, "text": f"{name}{index} ", "finish_reason": None, "logprobs": None}
        event = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _send(
    send: Any,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, *, kill: bool = True) -> None:
        """Stop; `kill`: at once, in-flight connections cut (a killed backend), else gracefully."""
        self.server.should_exit = True
        self.server.force_exit = kill
        self.thread.join(TIMEOUT)


@contextmanager
def serve_app(
    app: Any, *, lifespan: Literal["auto", "on", "off"] = "off", kill: bool = True, **settings: Any
) -> Iterator[Served]:
    """`app` on 127.0.0.1 (a free port) in a thread, until the block ends; `settings`: more
    uvicorn.Config arguments."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    config = uvicorn.Config(
        app, log_config=None, access_log=False, lifespan=lifespan, timeout_graceful_shutdown=1, **settings
    )
    server = _ThreadServer(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    served = Served(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    try:
        for _ in range(int(TIMEOUT * 100)):
            if server.started:
                break
            threading.Event().wait(0.01)
        yield served
    finally:
        served.stop(kill=kill)
        sock.close()
