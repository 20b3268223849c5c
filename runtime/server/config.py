"""The HTTP server's own settings (`kvasir serve` flags beyond the engine's), each also a KVASIR_* variable."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvasir.runtime.engine_args import Flag, add_flag

LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, whom it lets in, how much it queues and how it shuts down."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None  # None: /v1/* is open
    # Sequences that may wait beyond the --max-num-seqs that run; past that, 429 (see docs/serving.md).
    max_queue_len: int = 512
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    retry_after: int = 1  # seconds a 429/503 asks the client to wait (the Retry-After header)
    # Larger request bodies get 413 before they are parsed (a 128k-token prompt is ~1 MB of JSON).
    max_request_bytes: int = 32 << 20
    # A request's headers and body must arrive within this many seconds of its first byte, and an
    # idle keep-alive connection closes after `keep_alive_timeout`: slow clients hold no socket.
    request_read_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    log_format: str = "text"
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be at least 0, got {self.max_queue_len}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be at least 0 seconds, got {self.drain_timeout}")
        if self.retry_after < 0:
            raise ValueError(f"retry_after must be at least 0 seconds, got {self.retry_after}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {self.max_request_bytes}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")


_DEFAULTS = ServerConfig()
SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("--host", default=_DEFAULTS.host, help="address to listen on (default: 0.0.0.0, every interface)"),
    Flag("--port", type=int, default=_DEFAULTS.port, minimum=0, maximum=65535, help="0: any free port"),
    Flag("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (also KVASIR_API_KEY)"),
    Flag(
        "--max-queue-len",
        type=int,
        default=_DEFAULTS.max_queue_len,
        minimum=0,
        help="sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After",
    ),
    Flag(
        "--drain-timeout",
        type=float,
        default=_DEFAULTS.drain_timeout,
        minimum=0,
        maximum=3600,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    ),
    Flag(
        "--retry-after",
        type=int,
        default=_DEFAULTS.retry_after,
        minimum=0,
        help="Retry-After seconds on 429 and 503",
    ),
    Flag(
        "--max-request-bytes",
        type=int,
        default=_DEFAULTS.max_request_bytes,
        minimum=1,
        help="larger request bodies are refused with 413 before they are parsed",
    ),
    Flag(
        "--request-read-timeout",
        type=float,
        default=_DEFAULTS.request_read_timeout,
        minimum=0.1,
        maximum=3600,
        help="seconds a request's headers and body may take to arrive; slower connections get 408 and are closed",
    ),
    Flag(
        "--keep-alive-timeout",
        type=float,
        default=_DEFAULTS.keep_alive_timeout,
        minimum=0.1,
        maximum=3600,
        help="seconds an idle keep-alive connection stays open",
    ),
    Flag("--log-format", default=_DEFAULTS.log_format, choices=LOG_FORMATS),
    Flag("--log-level", default=_DEFAULTS.log_level, choices=("debug", "info", "warning", "error")),
)
_BY_NAME = {flag.name: flag for flag in SERVER_FLAGS}


def server_flag(name: str) -> Flag:
    """The definition of one server flag (KeyError for an unknown name)."""
    return _BY_NAME[name]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (each also readable from KVASIR_<FLAG>)")
    for flag in SERVER_FLAGS:
        add_flag(group, flag)  # type: ignore[arg-type]


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the ServerConfig; raises ValueError naming the bad value."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        drain_timeout=args.drain_timeout,
        retry_after=args.retry_after,
        max_request_bytes=args.max_request_bytes,
        request_read_timeout=args.request_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        log_format=args.log_format,
        log_level=args.log_level,
    )
