"""`bench/replay_table.py` writes one row per (method, node cap) and the markdown table, with
the same figures `tts replay` gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.unit.test_replay import _synthetic_log
from tts_service.replay import read_log, replay, replay_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_has_every_cell_and_the_replay_figures(tmp_path):
    log, out = tmp_path / "log.jsonl.gz", tmp_path / "rows.jsonl"
    _synthetic_log(log)
    cmd = [sys.executable, "bench/replay_table.py", "--trajectories", str(log)]
    cmd += ["--methods", "stand", "stand-dyn", "--nodes", "4", "16", "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["nodes"]) for r in rows] == [
        ("stand", 4),
        ("stand", 16),
        ("stand-dyn", 4),
        ("stand-dyn", 16),
    ]
    problems, _ = read_log(log)
    req = SimpleNamespace(method="stand-dyn", nodes=16, tree=None, vocab_size=None)
    direct = replay(problems, replay_config(req), 16, req.vocab_size).to_dict()
    assert rows[3]["acceptance_length"] == direct["acceptance_length"]
    assert f"| stand-dyn | 16 | {direct['mean_tree_nodes']:.1f} |" in res.stdout
