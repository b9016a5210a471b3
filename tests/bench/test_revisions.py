"""`bench/revisions.py`'s table: new ÷ base speed per cell and method, on both clocks, and
whether the two revisions committed the same tokens (the timed runs themselves need minutes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("revisions", ROOT / "bench" / "revisions.py")
revisions = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(revisions)


def _run(revision: str, method: str, process_s: float, decode_s: float, sha: str) -> dict:
    return {
        "revision": revision,
        "method": method,
        "cell": [1, 16, 1, 0.6],
        "process_s": process_s,
        "decode_s": decode_s,
        "tokens_sha": sha,
    }


def test_the_table_divides_speeds_and_compares_tokens(tmp_path):
    records = [
        _run("base", "plain", 10.0, 8.0, "a"),
        _run("new", "plain", 8.0, 5.0, "a"),
        _run("base", "auto", 6.0, 4.0, "b"),
        _run("new", "auto", 6.0, 4.0, "c"),
        {**_run("new", "auto", 1.0, 1.0, "c"), "error": ["exit 1"]},  # failed runs are left out
    ]
    rows = revisions.table(records).splitlines()[2:]
    assert rows == [
        "| 1 | 16 | 1 | 0.6 | auto | 6.00 / 4.00 | 6.00 / 4.00 | 1.000 / 1.000 | False |",
        "| 1 | 16 | 1 | 0.6 | plain | 10.00 / 8.00 | 8.00 / 5.00 | 1.250 / 1.600 | True |",
    ]
    out = tmp_path / "runs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    cmd = [sys.executable, "bench/revisions.py", "--table-from", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    assert res.stdout.strip().splitlines()[2:] == rows
