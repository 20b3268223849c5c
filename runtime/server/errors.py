"""Every error the server returns has the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError` (or let `InvalidParameterError` escape); the exception handlers installed
here turn those, FastAPI's validation errors (422 in FastAPI, 400 here, as OpenAI answers) and
Starlette's 404/405 into that shape, so clients such as the `openai` SDK raise their own classes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvasir.runtime.engine.async_engine import EngineDeadError
from kvasir.runtime.engine.prompt_check import ContextLengthError
from kvasir.runtime.loader.chat_template import ChatTemplateError
from kvasir.runtime.sample.params import InvalidParameterError

logger = logging.getLogger(__name__)

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer: HTTP status, message, and the OpenAI `param` / `code` fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(error: InvalidParameterError) -> APIError:
    if isinstance(error, ContextLengthError):  # its message is a whole sentence naming both lengths
        return APIError(400, error.message, param=error.param, code="context_length_exceeded")
    return APIError(400, str(error), param=error.param, code="invalid_value")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def validation_param(loc: Sequence[str | int]) -> str | None:
    """The field a pydantic error location names: ("body", "messages", 0, "content") -> "messages.0.content".

    Union members add a type tag to the location ("prompt", "list[int]", 2); the path stops there."""
    parts: list[str] = []
    for part in loc[1:]:
        if isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_TAGS):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def _validation_error(error: RequestValidationError) -> APIError:
    errors = error.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    kind = first.get("type")
    param = validation_param(tuple(first.get("loc", ("body",))))
    if kind == "json_invalid":
        context = first.get("ctx")
        detail = context.get("error", "") if isinstance(context, dict) else ""
        return APIError(400, f"The request body is not valid JSON: {detail}")
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: {param}", param=param)
    if param is None:
        return APIError(400, f"The request body is invalid: {first.get('msg')}")
    return APIError(400, f"Invalid value for {param}: {first.get('msg')}", param=param)


def to_api_error(error: Exception) -> APIError:
    """The OpenAI-shaped answer for any exception a request can end in."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidParameterError):
        return bad_request(error)
    if isinstance(error, ChatTemplateError):
        return APIError(400, str(error), param="messages", code="chat_template_error")
    if isinstance(error, RequestValidationError):
        return _validation_error(error)
    if isinstance(error, StarletteHTTPException):
        return APIError(error.status_code, str(error.detail), headers=error.headers)
    if isinstance(error, EngineDeadError):
        # Another replica can serve it; /health fails meanwhile, so the pod gets restarted.
        return APIError(503, f"The engine is not running: {error}", code="engine_dead")
    logger.error("unhandled error", exc_info=error)
    return APIError(500, "Internal server error", code="internal_error")


async def _handle(request: Request, error: Exception) -> JSONResponse:
    if isinstance(error, RequestValidationError) and _body_missing(error):
        return _missing_body(request).response()
    return to_api_error(error).response()


def _body_missing(error: RequestValidationError) -> bool:
    errors = error.errors()
    return (
        len(errors) == 1
        and errors[0].get("type") == "missing"
        and tuple(errors[0].get("loc", ())) == ("body",)
    )


def _missing_body(request: Request) -> APIError:
    """An empty body: name the first parameter the endpoint requires, as a missing field would be."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    model = getattr(getattr(field, "field_info", None), "annotation", None)
    required = [name for name, info in getattr(model, "model_fields", {}).items() if info.is_required()]
    if required:
        return APIError(
            400,
            f"Missing required parameter: {required[0]} (the request body is empty; "
            f"required: {', '.join(required)})",
            param=required[0],
        )
    return APIError(400, "The request body is empty: a JSON object is required")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception a handler can raise in the OpenAI shape."""
    for kind in (
        APIError,
        InvalidParameterError,
        ChatTemplateError,
        RequestValidationError,
        StarletteHTTPException,
        EngineDeadError,
        Exception,
    ):
        app.add_exception_handler(kind, _handle)
