"""The `kvasir` command: one entry point whose subcommands live in the packages that own them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn


def _version() -> str:
    try:
        return version("kvasir")
    except PackageNotFoundError:
        return "unknown"


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (the usage of `kvasir serve` is forty):
    `kvasir serve: error: argument --port: ... (see kvasir serve --help)`, exit status 2. The
    subcommands' parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level, so `kvasir --help` stays fast and the operator's
    # subcommands never pay for torch (and the runtime's never pay for kopf).
    import kvasir.operator.cli as operator_cli
    import kvasir.router.cli as router_cli
    import kvasir.runtime.cli as runtime_cli
    import kvasir.simulator.cli as simulator_cli

    parser = Parser(prog="kvasir", description="Kvasir LLM inference platform")
    parser.add_argument("--version", action="version", version=f"kvasir {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    runtime_cli.register(subparsers)
    operator_cli.register(subparsers)
    simulator_cli.register(subparsers)
    router_cli.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvasir.runtime.settings import bad_environment

    parser = build_parser()
    args = parser.parse_args(argv)
    # A KVASIR_* variable the command's flag refuses (and the command line did not override).
    problem = bad_environment(args)
    if problem is not None:
        print(f"kvasir {args.command}: error: {problem}", file=sys.stderr)
        return 2
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
