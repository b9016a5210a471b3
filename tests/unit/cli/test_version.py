"""`tts --version` answers at once: it imports none of the heavy libraries."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "ray", "numba")


def test_version_imports_no_heavy_library():
    probe = (
        "import sys; sys.argv = ['tts', '--version']; from tts_service.entry import main; "
        f"code = main(); print(sorted(m for m in {HEAVY!r} if m in sys.modules), code)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("tts ") and lines[-1] == "[] 0", out.stdout
