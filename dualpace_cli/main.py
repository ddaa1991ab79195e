"""The `dualpace` command: dispatches to the subcommand modules of this package (each has
register(subparsers) and run(args))."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dualpace.errors import DualPaceError

# Subcommand modules, imported lazily so `dualpace --help` stays fast.
_COMMAND_MODULES = (
    "dualpace_cli.generate",
    "dualpace_cli.model",
    "dualpace_cli.up",
    "dualpace_cli.client",
    "dualpace_cli.bench",
    "dualpace_cli.sim",
    "dualpace_cli.profile",
    "dualpace_cli.cluster",
)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="dualpace", description="DualPace LLM serving runtime")
    parser.add_argument("--traceback", action="store_true", help="show full tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for module_name in _COMMAND_MODULES:
        module = importlib.import_module(module_name)
        module.register(subparsers)
        modules[module_name.rpartition(".")[2]] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    show_traceback = args.traceback or os.environ.get("DUALPACE_TRACEBACK") == "1"
    try:
        return int(modules[args.command].run(args) or 0)
    except DualPaceError as exc:
        if show_traceback:
            raise
        print(f"dualpace {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
