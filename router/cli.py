"""`kvasir router`: the command-line entry of the router."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from kvasir.router.config import add_router_args

    parser = subparsers.add_parser(
        "router",
        help="route OpenAI requests across kvasir serve replicas (prefix affinity, queue, KV usage)",
        description="An OpenAI-compatible reverse proxy in front of several kvasir serve replicas: "
        "each request goes where its prompt's prefix is probably cached and the queue is short "
        "(docs/routing.md).",
    )
    add_router_args(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from kvasir.router.config import router_config_from_args
    from kvasir.router.server import run_router

    try:
        config = router_config_from_args(args)
    except ValueError as exc:
        print(f"kvasir router: {exc}", file=sys.stderr)
        return 2
    return run_router(config)
