"""The usage-error path every `tts` command shares: bad input is one line on stderr naming the
field, exit code 2. Light (argparse alone), so `tts --help` imports nothing more."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
