"""`tts --version`, `tts --help` and every subcommand's `--help` answer at once: they import
none of the heavy libraries (each costs seconds on a small CPU; torch alone ~2.3 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tts_service.cli import COMMANDS

HEAVY = ("torch", "transformers", "ray", "numba")


def heavy_imports(*argv: str) -> tuple[list[str], str]:
    """The heavy libraries `tts argv` imported, in a fresh interpreter, and what it printed."""
    probe = (
        f"import sys; sys.argv = ['tts', *{argv!r}]; from tts_service.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"import json; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    *printed, imported = out.stdout.splitlines()
    return json.loads(imported), "\n".join(printed)


def test_version_imports_no_heavy_library():
    imported, printed = heavy_imports("--version")
    assert printed.startswith("tts ") and imported == []


@pytest.mark.parametrize("argv", [("--help",), *((name, "--help") for name in COMMANDS)])
def test_help_imports_no_heavy_library(argv):
    imported, printed = heavy_imports(*argv)
    assert printed.startswith("usage: tts") and imported == []
    if len(argv) == 1:
        assert all(name in printed for name in COMMANDS)  # every command listed, none built


def test_a_command_still_builds_its_flags():
    _, printed = heavy_imports("solve", "--help")
    assert "--method" in printed and "--num-nodes" in printed
