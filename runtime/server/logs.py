"""Logging: one access line per request (id, status, tokens, latency), as text or JSON.

`AccessLogMiddleware` is plain ASGI (not Starlette's BaseHTTPMiddleware, which buffers streams and
hides disconnects): it puts a `RequestLog` in the scope for the handler to fill, and writes the
line when the last byte of the response has been sent, so a stream is logged when it ends. Probe
endpoints (/health, /ready, /metrics) are logged at DEBUG so they do not drown the rest.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("kvasir.access")

_PROBES = frozenset({"/health", "/ready", "/metrics"})
_SCOPE_KEY = "kvasir.request_log"


@dataclass
class RequestLog:
    """The fields of one access line; the handler fills in what it knows."""

    method: str
    path: str
    status: int = 0
    request_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    latency_s: float = 0.0


def request_log(scope: Scope) -> RequestLog | None:
    """The RequestLog the middleware put in this request's scope (None outside the middleware)."""
    log = scope.get(_SCOPE_KEY)
    return log if isinstance(log, RequestLog) else None


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        log = RequestLog(method=scope["method"], path=scope["path"])
        scope[_SCOPE_KEY] = log
        started = time.perf_counter()
        written = False

        def write() -> None:
            nonlocal written
            if written:
                return
            written = True
            log.latency_s = time.perf_counter() - started
            level = logging.DEBUG if log.path in _PROBES else logging.INFO
            if access_logger.isEnabledFor(level):
                access_logger.log(level, _text(log), extra={"access": asdict(log)})

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                log.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write()

        try:
            await self.app(scope, receive, logging_send)
        except BaseException:
            log.status = log.status or 500
            raise
        finally:
            if not log.status:
                log.status = 499  # the client left before any answer (nginx's "client closed request")
            write()


def _text(log: RequestLog) -> str:
    line = f"{log.method} {log.path} {log.status} {log.latency_s * 1000:.1f}ms"
    if log.request_id is not None:
        line += f" id={log.request_id}"
    if log.prompt_tokens is not None:
        line += f" prompt_tokens={log.prompt_tokens} completion_tokens={log.completion_tokens}"
    if log.finish_reason is not None:
        line += f" finish_reason={log.finish_reason}"
    return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            entry.update(access)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str, level: str) -> None:
    """Root logging for `kvasir serve` (uvicorn's loggers included) as text or JSON lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
