"""The `tts` command's process entry: the collector held from before the CLI's imports
(`startup.hold`) until a runner host is up (`startup.settle`) or the command ends."""

from __future__ import annotations

from tts_service import startup


def main() -> int:
    with startup.held():
        from tts_service.cli import main as cli

        return cli()
