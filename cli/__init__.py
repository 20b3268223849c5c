"""The `kvasir` command: one entry point whose subcommands live in the packages that own them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("kvasir")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level, so `kvasir --help` stays fast and the operator's
    # subcommands never pay for torch (and the runtime's never pay for kopf).
    import kvasir.operator.cli as operator_cli
    import kvasir.router.cli as router_cli
    import kvasir.runtime.cli as runtime_cli
    import kvasir.simulator.cli as simulator_cli

    parser = argparse.ArgumentParser(prog="kvasir", description="Kvasir LLM inference platform")
    parser.add_argument("--version", action="version", version=f"kvasir {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    runtime_cli.register(subparsers)
    operator_cli.register(subparsers)
    simulator_cli.register(subparsers)
    router_cli.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
