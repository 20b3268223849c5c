"""Running the app on uvicorn, with a graceful drain on SIGTERM (and SIGINT).

uvicorn's own handling of SIGTERM closes the listening socket at once (new requests would see
"connection refused", not 503) and re-raises the signal on the way out (exit code 143, not 0).
Kubernetes expects a pod to keep answering while it leaves the endpoints, so here the first
signal only starts the drain: /ready turns false, new requests get 503, in-flight ones finish
(aborted after --drain-timeout), and then uvicorn shuts down and the process exits 0. A second
signal stops at once, as uvicorn would.
"""

from __future__ import annotations

import logging

import uvicorn

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.draining import DrainingServer
from kvasir.runtime.server.http_protocol import uvicorn_http_settings
from kvasir.runtime.server.logs import configure_logging
from kvasir.runtime.threads import apply_threads

logger = logging.getLogger(__name__)

# After the drain, responses still being written get this long before uvicorn cancels them.
_GRACEFUL_SHUTDOWN_SECONDS = 5


def run_server(engine_config: EngineConfig, config: ServerConfig, *, threads: int | None = None) -> int:
    """Serve until drained after a signal; 0 then, 1 if the model failed to load. `threads`: torch's
    CPU threads (None: runtime/threads.py chooses).

    Raises ValueError for a bad setting found before serving (e.g. an OTEL_* variable)."""
    configure_logging(config.log_format, config.log_level)
    apply_threads(threads)
    exit_code = 0
    server: DrainingServer | None = None

    def fatal() -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    app = build_app(engine_config, config, on_fatal=fatal)
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,  # configure_logging has set up the root logger
        access_log=False,  # the app writes its own access line, with tokens
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS,
        **uvicorn_http_settings(config.request_read_timeout, config.keep_alive_timeout),
    )
    server = DrainingServer(uvicorn_config, app.state.kvasir.lifecycle, config.drain_timeout)
    warning = open_to_the_network(config)
    if warning:
        logger.warning(warning)
    logger.info("loading %s", engine_config.model_name)
    server.run()
    return exit_code


def open_to_the_network(config: ServerConfig) -> str | None:
    """The start-up warning for a server every host that reaches it may use, or None."""
    if config.api_key is not None or config.host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (
        f"listening on {config.host}:{config.port} (every interface) with no API key: anyone who "
        "reaches this port can use the model; set --api-key (or KVASIR_API_KEY), or --host 127.0.0.1"
    )
