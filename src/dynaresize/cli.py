"""Command-line entry point: `dynaresize {run,simulate,compare,bench,report,advise,preflight}`.

Each subcommand lives in `dynaresize.commands.<name>` with `add_parser(subparsers)` and
`main(args) -> int`; this module only dispatches and turns user errors into one line on
stderr and exit code 2 (1 for a bad checkpoint), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dynaresize import __version__
from dynaresize.errors import CheckpointError, ConfigError, UserError

COMMANDS = ("run", "simulate", "compare", "bench", "report", "advise", "preflight")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynaresize",
        description="Disaggregated, pipelined RL post-training that moves devices between the "
        "rollout and training pools while the job runs.",
    )
    parser.add_argument("--version", action="version", version=f"dynaresize {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"dynaresize.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        for line in exc.errors:
            print(f"dynaresize: config error: {line}", file=sys.stderr)
        return exc.exit_code
    except UserError as exc:
        print(f"dynaresize: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except CheckpointError as exc:
        print(f"dynaresize: checkpoint error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dynaresize: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
