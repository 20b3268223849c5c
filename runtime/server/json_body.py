"""Request bodies decoded off the event loop when they are large.

FastAPI decodes a JSON body with `json.loads` on the event loop: a 30 MB body holds it for a few
hundred milliseconds, during which no stream advances and /health does not answer. Routes of this
class hand bodies over `OFF_LOOP_BYTES` to a worker thread instead (small ones stay inline, where a
thread hop would cost more than the decode)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 256 << 10


class OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(json.loads, body)
            else:
                self._json = json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return route
