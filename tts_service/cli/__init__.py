"""The `tts` command (also `python -m tts_service`).

Each subcommand parses flags over a YAML preset, validates everything with pydantic before
loading anything, and exits with code 2 and one line on stderr naming the bad field. One module
per subcommand contributes its parser and its `run`; this one wires them and owns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tts_service import startup
from tts_service.cli import calibrate, generate, job, replay, serve, solve, store
from tts_service.cli.common import Parser, UsageError

COMMANDS = (generate, solve, calibrate, replay, store, job, serve)  # the order --help lists
HOSTS = frozenset(m.__name__ for m in (generate, solve))
"""Commands that build a runner host, whose start ends the process's start-up
(`startup.settle`, once the model is loaded); every other command's ends once its arguments are
read (a replay, a calibration or a log that follows a job runs long, the collector on)."""


def make_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = Parser(prog="tts", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tts {version('tts-service')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the flags as typed
        if args.func.__module__ not in HOSTS:
            startup.settle()
        return args.func(args)
    except UsageError as e:
        print(f"tts: error: {e}", file=sys.stderr)
        return 2
