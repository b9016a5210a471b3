"""The `tts` command (also `python -m tts_service`).

Each subcommand parses flags over a YAML preset, validates everything with pydantic before
loading anything, and exits with code 2 and one line on stderr naming the bad field. One module
per subcommand contributes its flags (`add_arguments`) and its `run`; this one wires them and
owns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence
from typing import NamedTuple

from tts_service import startup
from tts_service.cli.usage import Parser, UsageError


class Command(NamedTuple):
    module: str  # under tts_service.cli: its `add_arguments` and `run`
    help: str  # its line in `tts --help`


COMMANDS: dict[str, Command] = {  # in the order `tts --help` lists them
    "generate": Command("generate", "one generation with a speculative method"),
    "solve": Command("solve", "best-of-N trajectories sharing one n-gram store"),
    "calibrate-tree": Command("calibrate", "data-driven STAND tree (625 nodes -> best K)"),
    "replay": Command("replay", "acceptance length of a drafter on a trajectory log"),
    "store": Command("store", "look at or clean the Redis n-gram store"),
    "job": Command("job", "submit and follow best-of-N Ray jobs"),
    "serve": Command("serve", "the OpenAI-compatible HTTP endpoint on Ray Serve"),
}
HOSTS = frozenset({"generate", "solve"})
"""Commands that build a runner host, whose start ends the process's start-up
(`startup.settle`, once the model is loaded); every other command's ends once its arguments are
read (a replay, a calibration or a log that follows a job runs long, the collector on)."""


def make_parser(built: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The `tts` parser, with the flags of the commands in `built` (None: every command).

    A command's module is imported only to build its flags, so `tts --help` imports none and
    `tts solve --help` only what solve's flags need (pydantic and the drafters' configs: never
    torch, transformers, ray or numba)."""
    from importlib.metadata import version

    parser = Parser(prog="tts", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tts {version('tts-service')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if built is None or name in built:
            importlib.import_module(f"tts_service.cli.{command.module}").add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if not a.startswith("-")), None)  # `tts` takes no valued flag
    try:
        args = make_parser(built={named} if named else set()).parse_args(argv)
        args.argv = argv  # the flags as typed
        if args.command not in HOSTS:
            startup.settle()
        return args.func(args)
    except UsageError as e:
        print(f"tts: error: {e}", file=sys.stderr)
        return 2
