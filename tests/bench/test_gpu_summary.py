"""`bench/gpu_summary.py`: each target's record from a GPU run's JSON, met or not, and a step
cut short is a target recorded as not measured."""

from __future__ import annotations

import json

from bench import gpu_summary as gs

DEVICE = {
    "forward": "compact",
    "copy_bandwidth_gb_s": 4000.0,
    "bandwidth_bound_tokens_per_s": 263.0,
    "plain_tokens_per_s": 210.0,
    "surface_context": 4096,
    "verify_cost_ms": {"16": {"1": 9.0}},
}


def _replay(method: str, tokens_per_s: float, seconds: float, forwards: int) -> dict:
    return {
        "tokens_per_s": tokens_per_s,
        "seconds": seconds,
        "target_forwards": forwards,
        "context": 4096,
        "new_tokens": 8192,
        "trajectories": 32,
        "nodes_per_row": [[0.01, 16, 8 if method != "plain" else 0]],
    }


def _write(folder, device=True, replay=True, predict=True):
    if device:
        (folder / gs.DEVICE_JSON).write_text(json.dumps(DEVICE))
    if replay:
        (folder / "long").mkdir()
        runs = {
            "plain": [_replay("plain", 1000.0, 8.2, 512), _replay("plain", 1010.0, 8.1, 512)],
            "stand": [_replay("stand", 1400.0, 5.9, 250), _replay("stand", 1380.0, 6.0, 250)],
            "auto": [_replay("auto", 1600.0, 5.1, 240), _replay("auto", 1550.0, 5.3, 240)],
        }
        (folder / gs.REPLAY_JSON).write_text(json.dumps(runs))
    if predict:
        cells = [
            {"method": "plain", "rows": 16, "context": 4096, "refit_error": 0.1},
            {"method": "stand", "rows": 64, "context": 4096, "refit_error": -0.3},
            {"method": "auto", "rows": 16, "context": 4096},  # predicted only: not a cell
        ]
        (folder / gs.PREDICT_JSON).write_text(json.dumps(cells))


def test_every_target_from_a_complete_run(tmp_path):
    _write(tmp_path)
    got = {r["target"]: r for r in gs.summarize(tmp_path)}
    assert list(got) == [1, 2, 3, 4, 5, 6]
    assert got[1]["measured"] == round(210 / 263, 3) and got[1]["met"]
    kv_s = 16 * 4097 * gs.SHAPE.kv_bytes_per_token() / 4000e9
    assert got[2]["measured"] == round(9e-3 / (1 / 263 + kv_s), 3)
    assert got[3]["goal"] == ">= 0.6" and 0 < got[3]["measured"] < 1
    assert got[4]["measured"] == round((250 / 6.0 * 0 + 5.95 / 250) / (8.15 / 512), 3)
    assert not got[4]["met"]
    assert got[5]["measured"] == round(1575 / 1005, 3) and got[5]["met"]
    assert got[6]["measured"] == -0.3 and not got[6]["met"] and "64 rows" in got[6]["figure"]


def test_a_step_cut_short_is_a_target_not_measured(tmp_path):
    _write(tmp_path, replay=False, predict=False)
    got = {r["target"]: r for r in gs.summarize(tmp_path)}
    assert got[1]["met"] and got[2]["measured"] is not None
    for target in (3, 4, 5, 6):
        assert got[target]["measured"] is None and not got[target]["met"]
        assert "not measured" in got[target]["figure"]
    assert gs.REPLAY_JSON in got[3]["figure"] and gs.PREDICT_JSON in got[6]["figure"]
