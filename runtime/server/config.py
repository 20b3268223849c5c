"""The HTTP server's own settings (`kvasir serve` flags beyond the engine's), each also a KVASIR_* variable."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvasir.runtime.engine_args import add_flag

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


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (each also readable from KVASIR_<FLAG>)")
    defaults = ServerConfig()
    flags: list[tuple[str, dict[str, object]]] = [
        ("--host", {"default": defaults.host, "help": "address to listen on"}),
        ("--port", {"type": int, "default": defaults.port, "help": "port to listen on (0: any free port)"}),
        ("--api-key", {"help": "require `Authorization: Bearer KEY` on /v1/* (also KVASIR_API_KEY)"}),
        (
            "--max-queue-len",
            {
                "type": int,
                "default": defaults.max_queue_len,
                "help": "sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After",
            },
        ),
        (
            "--drain-timeout",
            {
                "type": float,
                "default": defaults.drain_timeout,
                "help": "seconds in-flight requests get to finish after SIGTERM before they are aborted",
            },
        ),
        (
            "--retry-after",
            {"type": int, "default": defaults.retry_after, "help": "Retry-After seconds on 429 and 503"},
        ),
        (
            "--max-request-bytes",
            {
                "type": int,
                "default": defaults.max_request_bytes,
                "help": "larger request bodies are refused with 413 before they are parsed",
            },
        ),
        ("--log-format", {"default": defaults.log_format, "choices": LOG_FORMATS}),
        (
            "--log-level",
            {"default": defaults.log_level, "choices": ("debug", "info", "warning", "error")},
        ),
    ]
    for flag, kwargs in flags:
        add_flag(group, flag, **kwargs)  # type: ignore[arg-type]


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
        log_format=args.log_format,
        log_level=args.log_level,
    )
