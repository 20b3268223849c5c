"""`kvasir serve --headless`: a worker node of a multi-node group, with /health and /ready only.

Node 0 of a group (`--nnodes M`) serves the OpenAI API; nodes 1..M-1 run only their ranks
(`engine/ranks/node_agent.py`), driven by node 0. Their pods still need probes, so this serves two
endpoints on --host/--port with the standard library's HTTP server (no API, no FastAPI):

- `GET /health`: 200 while this node's ranks run, 503 once one died or hung or the leader is gone
  (the process exits right after);
- `GET /ready`: 200 once every rank of this node has built its runner, 503 before.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.ranks.node_agent import NodeAgent
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.logs import configure_logging
from kvasir.runtime.server.process_exit import exit_without_teardown

logger = logging.getLogger(__name__)


def check_node_role(engine: EngineConfig, server: ServerConfig) -> None:
    """ValueError unless --headless and --node-rank agree: node 0 serves, the others are headless."""
    if server.headless and engine.node_rank == 0:
        raise ValueError(
            "--headless runs a node above 0 of a multi-node group: give --nnodes and --node-rank "
            "(node 0 serves the API and drives the others)"
        )
    if not server.headless and engine.node_rank > 0:
        raise ValueError(
            f"--node-rank {engine.node_rank} only runs its ranks: add --headless (node 0 serves the API)"
        )


def run_headless(engine: EngineConfig, server: ServerConfig, *, threads: int | None = None) -> NoReturn:
    """Run this node until the leader stops the group (0) or it fails (1; one line on stderr).
    The process ends here, with `os._exit`: see `exit_without_teardown`."""
    configure_logging(server.log_format, server.log_level)
    agent = NodeAgent(engine, threads)
    health = _health_server(server.host, server.port, agent)
    host, port = health.server_address[:2]
    logger.info(
        "headless node %d of %d: /health and /ready on http://%s:%d; no API",
        engine.node_rank,
        engine.nnodes,
        host,
        port,
    )
    threading.Thread(target=health.serve_forever, name="kvasir-node-health", daemon=True).start()
    try:
        code = agent.run()
    except ConnectionError as error:
        logger.error("%s", error)
        code = 1
    health.shutdown()
    health.server_close()
    exit_without_teardown(code)


def _health_server(host: str, port: int, agent: NodeAgent) -> ThreadingHTTPServer:
    class Probes(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(agent.alive, "ok" if agent.alive else "failed")
            elif self.path == "/ready":
                self._answer(agent.ready, "ready" if agent.ready else "not ready")
            else:
                self._answer(False, "this node is headless: it serves /health and /ready only", status=404)

        def _answer(self, ok: bool, status_text: str, status: int | None = None) -> None:
            body = json.dumps({"status": status_text}).encode()
            self.send_response(status or (200 if ok else 503))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds would flood the log

    return ThreadingHTTPServer((host, port), Probes)
