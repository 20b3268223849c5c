"""The runtime's subcommands of `kvasir`: generate (offline batch) and, later, serve."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the runtime's subcommands to the top-level `kvasir` parser."""
    generate = subparsers.add_parser("generate", help="run an offline batch of prompts")
    generate.set_defaults(handler=_not_yet)


def _not_yet(args: argparse.Namespace) -> int:
    raise SystemExit("not implemented yet")
