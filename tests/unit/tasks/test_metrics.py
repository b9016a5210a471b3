"""Metrics on hand-made outcomes with known values, and the report files they produce."""

from __future__ import annotations

import json
from math import comb

import pytest

from tts_service.tasks import report
from tts_service.tasks.metrics import ItemOutcome, ks_for, pass_at_k, summarize


def _item(correct, maj, tokens=100, forwards=50, wall=2.0) -> ItemOutcome:
    return ItemOutcome(tuple(correct), maj, tokens, forwards, wall)


# 4 items x 4 trajectories; maj_correct written by hand for k = 1, 2, 4
OUTCOMES = [
    _item([1, 1, 1, 1], {1: True, 2: True, 4: True}),
    _item([0, 1, 0, 1], {1: False, 2: False, 4: True}),
    _item([0, 0, 0, 1], {1: False, 2: False, 4: False}),
    _item([0, 0, 0, 0], {1: False, 2: False, 4: False}, tokens=300, forwards=100, wall=4.0),
]


def test_pass_at_k_matches_the_closed_form():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # = 0.5
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 4, 2) == 1.0  # fewer wrong samples than k
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_curve_points():
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(6) == [1, 2, 4, 6]
    assert ks_for(1) == [1]


def test_summary_values_on_known_outcomes():
    s = summarize(OUTCOMES)
    assert s["pass@1"]["value"] == pytest.approx((1 + 0.5 + 0.25 + 0) / 4)
    assert s["maj@n"]["value"] == 0.5
    assert s["pass@n"]["value"] == 0.75
    assert s["tokens_per_s"]["value"] == pytest.approx(600 / 10.0)  # summed, not averaged
    assert s["acceptance_length"]["value"] == pytest.approx(600 / 250)
    assert s["curve"]["k"] == [1, 2, 4]
    assert [e["value"] for e in s["curve"]["maj@k"]] == [0.25, 0.25, 0.5]
    assert s["curve"]["pass@k"][0]["value"] == s["pass@1"]["value"]


def test_bootstrap_intervals_contain_the_point_and_are_seeded():
    s = summarize(OUTCOMES)
    for key in ("pass@1", "maj@n", "pass@n", "tokens_per_s", "acceptance_length"):
        e = s[key]
        assert e["low"] <= e["value"] <= e["high"], key
    assert s["maj@n"]["low"] < s["maj@n"]["high"]  # 4 items: a wide interval
    assert summarize(OUTCOMES) == s
    same = [_item([1, 0], {1: True, 2: True})] * 5
    e = summarize(same)["pass@1"]
    assert e["value"] == e["low"] == e["high"] == 0.5  # no spread across identical items


def test_summary_rejects_ragged_items():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize([_item([1], {1: True}), _item([1, 0], {1: True, 2: True})])


def _write_run(out, task, method, kind, rows):
    d = out / task / method
    d.mkdir(parents=True)
    info = {
        "task": task,
        "method": method,
        "drafter": {"kind": kind},
        "model": "tiny",
        "n": 2,
        "data": "fixtures",
        "sandbox": None,
    }
    (d / "run.json").write_text(json.dumps(info))
    lines = [json.dumps(r) for r in rows]
    (d / "items.jsonl").write_text("\n".join(lines) + '\n{"id": "cut-by-a-cra')


def _row(i, correct, tokens, forwards, wall):
    return {
        "id": f"q{i}",
        "correct": correct,
        "maj_correct": {"1": correct[0], "2": correct[0]},
        "stats": {"new_tokens": tokens, "target_forwards": forwards, "wall_s": wall},
    }


def test_report_compares_methods_and_writes_json_markdown_and_plots(tmp_path):
    _write_run(
        tmp_path,
        "aime24",
        "plain",
        "plain",
        [_row(i, [i % 2 == 0, False], 100, 100, 10.0) for i in range(4)],
    )
    _write_run(
        tmp_path,
        "aime24",
        "stand",
        "stand",
        [_row(i, [True, i == 0], 100, 40, 5.0) for i in range(4)],
    )
    paths = report.write(tmp_path)
    assert [p.name for p in paths] == ["report.json", "report.md", "accuracy_vs_n.png", "speed.png"]
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths[0].read_text())
    by_method = {r["method"]: r for r in data["runs"]}
    assert by_method["stand"]["speedup_vs_plain"] == pytest.approx(2.0)
    assert by_method["stand"]["metrics"]["items"] == 4  # the cut last line is skipped
    assert by_method["stand"]["metrics"]["acceptance_length"]["value"] == 2.5
    md = paths[1].read_text()
    assert "| stand | 4 | 2 |" in md and "2.00x" in md and "toy items" in md


def test_no_graded_rows_means_no_report(tmp_path):
    assert report.write(tmp_path) == []
