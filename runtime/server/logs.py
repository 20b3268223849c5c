"""Logging: one access line per request (id, status, tokens, latency), as text or JSON.

`AccessLogMiddleware` is plain ASGI (not Starlette's BaseHTTPMiddleware, which buffers streams and
hides disconnects): it puts a `RequestLog` in the scope for the handler to fill, and writes the
line when the last byte of the response has been sent, so a stream is logged when it ends. Probe
endpoints (/health, /ready, /metrics) are logged at DEBUG so they do not drown the rest.

A client writes into these lines (its path is percent-decoded: `%0a` is a line feed), so both
formatters escape control characters in every message and field (`printable`), whatever logger
wrote it, and the text format indents the lines of a traceback: a line that starts at the margin
always starts a record.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvasir.runtime.server.printable import printable

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
        log = RequestLog(method=scope["method"], path=scope["path"])  # escaped when written
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
                access_logger.log(level, access_text(log), extra={"access": asdict(log)})

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


def access_text(log: RequestLog) -> str:
    """The access line's message (the formatter escapes it)."""
    line = f"{log.method} {log.path} {log.status} {log.latency_s * 1000:.1f}ms"
    if log.request_id is not None:
        line += f" id={log.request_id}"
    if log.prompt_tokens is not None:
        line += f" prompt_tokens={log.prompt_tokens} completion_tokens={log.completion_tokens}"
    if log.finish_reason is not None:
        line += f" finish_reason={log.finish_reason}"
    return line


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, the message escaped; traceback lines indented and escaped."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        escaped = logging.makeLogRecord({**record.__dict__, "message": printable(record.message)})
        return super().formatMessage(escaped)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(stack_info)


def _indented(text: str) -> str:
    return "\n".join("  " + printable(line) for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access line's fields, every
    string escaped (JSON escapes C0 itself, but not DEL, C1 or U+2028)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": printable(record.getMessage()),
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            entry.update({key: printable(v) if isinstance(v, str) else v for key, v in access.items()})
        if record.exc_info:
            text = self.formatException(record.exc_info)
            entry["exception"] = "\n".join(printable(line) for line in text.splitlines())
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(log_format: str, level: str) -> None:
    """Root logging for `kvasir serve` (uvicorn's loggers included) as text or JSON lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
