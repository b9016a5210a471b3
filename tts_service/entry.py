"""The `tts` command's process entry: the collector held from before the CLI's imports
(`startup.hold`) until a runner host is up (`startup.settle`) or the command ends."""

from __future__ import annotations

import sys

from tts_service import startup


def main() -> int:
    if sys.argv[1:] == ["--version"]:  # answered before the CLI's imports (torch among them)
        from importlib.metadata import version

        print(f"tts {version('tts-service')}")
        return 0
    try:
        with startup.held():
            from tts_service.cli import main as cli

            return cli()
    finally:
        startup.exiting()
