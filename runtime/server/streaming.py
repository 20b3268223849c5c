"""Server-sent events, and noticing a client that leaves, streaming or not.

A client that disconnects must abort its request in the engine (freeing its KV blocks) instead of
letting it generate for nobody. Both paths here watch for the ASGI `http.disconnect` message and
cancel the work when it comes; cancellation closes the engine stream, which queues the abort.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.server.errors import to_api_error
from kvasir.runtime.server.generation import Generation

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel) -> bytes:
    """One `data:` event holding a JSON object."""
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


def sse_error(error: Exception) -> bytes:
    """An error after the stream started (the status is already 200): an event with the OpenAI error body."""
    return b"data: " + json.dumps(to_api_error(error).body()).encode() + b"\n\n"


async def respond(
    request: Request,
    generation: Generation,
    *,
    stream: bool,
    chunks: Callable[[], AsyncGenerator[BaseModel, None]],
    last_chunk: Callable[[], BaseModel | None],
    whole: Callable[[list[list[Completion]]], BaseModel],
) -> Response:
    """Answer a generation request: SSE of `chunks()`, then `last_chunk()` and `[DONE]`; or, not
    streaming, `whole(choices per prompt)` as JSON once every choice has finished."""
    if stream:
        return EventStreamResponse(_events(chunks(), last_chunk), on_close=generation.close)
    try:
        results = await until_disconnected(request, generation.collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        generation.close()
    # Thousands of tokens with their logprobs take seconds to turn into objects: not on the event loop.
    # pydantic writes the JSON in one call that holds the interpreter, six times faster than
    # model_dump + json.dumps (0.07 s for 10 MB of logprobs), so the loop is never held for long.
    body = await asyncio.to_thread(lambda: whole(results).model_dump_json().encode())
    return Response(body, media_type="application/json")


async def _events(
    chunks: AsyncGenerator[BaseModel, None], last_chunk: Callable[[], BaseModel | None]
) -> AsyncGenerator[bytes, None]:
    try:
        async with aclosing(chunks) as items:
            async for item in items:
                yield sse_event(item)
        last = last_chunk()
        if last is not None:
            yield sse_event(last)
    except Exception as error:  # the headers are sent: the error travels as an event
        yield sse_error(error)
    yield DONE


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops (and so aborts the request) as soon as the client disconnects.

    Starlette only races the stream against a disconnect for ASGI spec < 2.4; this does it always.
    `on_close` runs however the response ends, even when the stream never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self._on_close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientDisconnected if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # The cancelled work is cleaning up (aborting its engine requests); let it finish.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the only message left to receive is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
