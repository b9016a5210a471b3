"""bench.acceptance_cost: every cell timed, at the shapes asked for."""

from __future__ import annotations

import json

from bench import acceptance_cost


def test_acceptance_cost_times_each_cell(tmp_path):
    out = tmp_path / "cost.json"
    assert acceptance_cost.main(["--vocab", "64", "--cells", "2x1", "3x4", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["rows"], r["tokens"], r["vocab"]) for r in records] == [(2, 1, 64), (3, 4, 64)]
    assert all(r["total_ms"] >= r["probs_ms"] > 0 and r["verdict_ms"] > 0 for r in records)
