"""Request bodies decoded and validated within bounds, off the event loop when they are large.

FastAPI decodes a JSON body and validates it against the route's pydantic model on the event loop,
and checks nothing about its shape first: a body of 300k tiny chat messages held the loop (and so
/health and every stream) for seconds, and one of 2M cost gigabytes. Routes of this class do it
themselves, in this order, each step answering 400 that names the field, once the API key (if the
server has one) has been checked: every route of this class is an API route, behind the key, and
a client without it gets 401 whatever its body holds (FastAPI would validate the body before the
route's dependencies run, so the key's own dependency comes too late for that):

1. the shape bounds, on the raw bytes, before any object is built (`json_shape`);
2. UTF-8 (RFC 8259 requires it; the byte-level walk relies on it), then `json.loads`;
3. no lone surrogate ("\\ud800") in any string or key: JSON escapes allow one, but it is not text,
   and neither the tokenizer nor the JSON answer can encode it (an iterative walk, no recursion,
   run only when the body has such an escape);
4. the route's pydantic model.

Bodies over `OFF_LOOP_BYTES` take all four steps on the server's worker threads. FastAPI then gets
the validated model (pydantic passes an instance of the model through unchanged).
"""

from __future__ import annotations

import email.message
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from kvasir.runtime.server.auth import authenticate
from kvasir.runtime.server.errors import APIError
from kvasir.runtime.server.json_shape import check_json_shape
from kvasir.runtime.server.printable import printable

# Below this, a thread hop costs more than the work (the bounds keep it to milliseconds).
OFF_LOOP_BYTES = 64 << 10

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs: any one left is lone


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """`body` as an instance of `model`; raises APIError or RequestValidationError (both 400)."""
    check_json_shape(body)
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise APIError(400, f"The request body is not valid UTF-8 (at byte {error.start}).") from None
    try:
        data = json.loads(text)
    except ValueError as error:  # malformed, or an integer of more than 4300 digits
        raise APIError(400, f"The request body is not valid JSON: {error}") from None
    if _SURROGATE_ESCAPE.search(body):
        path = lone_surrogate_path(data)
        if path is not None:
            where = ".".join(printable(str(part), 40) for part in path[:6]) + (".…" if len(path) > 6 else "")
            raise APIError(
                400,
                f"Invalid value for {where or 'the body'}: contains a lone surrogate (not valid Unicode text)",
                param=printable(str(path[0]), 40) if path else None,
            )
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def lone_surrogate_path(data: Any) -> tuple[str | int, ...] | None:
    """The path of the first string (or key) in `data` holding a lone surrogate, or None. Iterative,
    and linear in the size of `data` however deep it nests."""
    if isinstance(data, str):
        return () if _SURROGATE.search(data) else None
    steps: list[tuple[int, str | int]] = []  # (index of the parent step or -1, key): paths built on demand
    pending: list[tuple[Any, int]] = [(data, -1)]

    def path(parent: int, key: str | int) -> tuple[str | int, ...]:
        keys = [key]
        while parent >= 0:
            parent, step = steps[parent]
            keys.append(step)
        return tuple(reversed(keys))

    while pending:
        value, parent = pending.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                return path(parent, key)
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    return path(parent, key)
            elif isinstance(item, dict | list):
                steps.append((parent, key))
                pending.append((item, len(steps) - 1))
    return None


class _ParsedBodyRequest(Request):
    """A request whose JSON body has been parsed and validated already."""

    validated: BaseModel | None = None

    async def json(self) -> Any:
        if self.validated is None:  # FastAPI parses only what `_is_json` accepts too: never here
            raise APIError(400, "The request body could not be parsed.")
        return self.validated


class OffLoopJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)

        async def route(request: Request) -> Response:
            parsed = _ParsedBodyRequest(request.scope, request.receive)
            await authenticate(parsed)  # before anything is validated: 401 tells nothing of the body
            if model is not None and _is_json(parsed):
                body = await parsed.body()
                if body:
                    if len(body) > OFF_LOOP_BYTES:
                        state = parsed.app.state.kvasir
                        parsed.validated = await state.off_loop(lambda: parse_body(body, model))
                    else:
                        parsed.validated = parse_body(body, model)
            return await handler(parsed)

        return route


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    field = route.body_field
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _is_json(request: Request) -> bool:
    """Whether FastAPI would decode this body as JSON (its rule: an application/json or +json type)."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )
