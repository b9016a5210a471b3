"""The report files (JSON, Markdown, plots) written from hand-made run directories."""

from __future__ import annotations

import json

import pytest

from tts_service.tasks import report


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
