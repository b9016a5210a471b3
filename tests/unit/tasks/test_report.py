"""The report files (JSON, Markdown, plots) written from hand-made run directories."""

from __future__ import annotations

import json

import pytest

from tts_service.tasks import report


def _session(invocation, tokens, decode, host="box-a", load=0.5, setup=0.0):
    wall = decode + setup
    return {
        "invocation": invocation,
        "started": "2026-11-22T10:00:00Z",
        "host": host,
        "loadavg_start": [load, load, load],
        "loadavg_end": [load + 1, load, load],
        "new_tokens": tokens,
        "wall_s": wall,
        "setup_s": setup,
        "decode_s": decode,
        "tokens_per_s": tokens / wall,
        "decode_tokens_per_s": tokens / decode if decode else 0.0,
    }


def _write_run(out, task, method, kind, rows, sessions):
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
        "sessions": sessions,
    }
    (d / "run.json").write_text(json.dumps(info))
    lines = [json.dumps(r) for r in rows]
    (d / "items.jsonl").write_text("\n".join(lines) + '\n{"id": "cut-by-a-cra')


def _row(i, correct, tokens, forwards, answers=("1", "1"), finish=("stop", "stop")):
    trajectories = [
        {"index": j, "answer": a, "correct": c, "finish_reason": f}
        for j, (a, c, f) in enumerate(zip(answers, correct, finish, strict=True))
    ]
    return {
        "id": f"q{i}",
        "correct": correct,
        "maj_correct": {"1": correct[0], "2": correct[0]},
        "trajectories": trajectories,
        "stats": {"new_tokens": tokens, "target_forwards": forwards, "wall_s": 1.0},
    }


def _two_methods(out, stand_invocation, stand_host="box-a"):
    _write_run(
        out,
        "aime24",
        "plain",
        "plain",
        [_row(i, [i % 2 == 0, False], 100, 100, (None, "3"), ("length", "stop")) for i in range(4)],
        [_session("inv1", 400, 40.0)],
    )
    _write_run(
        out,
        "aime24",
        "stand",
        "stand",
        [_row(i, [True, i == 0], 100, 40) for i in range(4)],
        [_session(stand_invocation, 400, 20.0, host=stand_host, load=3.0)],
    )


def test_report_compares_methods_and_writes_json_markdown_and_plots(tmp_path):
    _two_methods(tmp_path, "inv1")
    paths = report.write(tmp_path)[:4]
    assert [p.name for p in paths] == ["report.json", "report.md", "accuracy_vs_n.png", "speed.png"]
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths[0].read_text())
    by_method = {r["method"]: r for r in data["runs"]}
    stand, plain = by_method["stand"], by_method["plain"]
    assert stand["speed_vs_plain"] == {"ratio": pytest.approx(2.0), "basis": "same invocation"}
    assert stand["speed"]["tokens_per_s"] == 20.0 and plain["speed"]["tokens_per_s"] == 10.0
    assert stand["metrics"]["items"] == 4  # the cut last line is skipped
    assert stand["metrics"]["acceptance_length"]["value"] == 2.5
    assert plain["metrics"]["no_answer_rate"]["value"] == 0.5
    assert plain["metrics"]["truncation_rate"]["value"] == 0.5
    assert stand["metrics"]["no_answer_rate"]["value"] == 0.0
    md = paths[1].read_text()
    assert "| stand | 4 | 2 |" in md and "2.00x (same invocation)" in md and "toy items" in md
    assert "| no answer | truncated |" in md
    assert "0.500 [0.500, 0.500] | 0.500 [0.500, 0.500]" in md  # plain's two rates


def test_runs_measured_apart_are_never_divided(tmp_path):
    _two_methods(tmp_path, "inv2", stand_host="box-b")
    data = report.build(tmp_path)
    stand = next(r for r in data["runs"] if r["method"] == "stand")
    assert stand["speed_vs_plain"] == {"ratio": None, "basis": "cross-run"}
    md = report.markdown(data)
    assert "cross-run: not compared" in md and "x (same invocation)" not in md
    assert "2.00x" not in md and "**Cross-run:**" in md
    for host, load in (("box-a", "0.50 / 1.50"), ("box-b", "3.00 / 4.00")):
        assert f"| {host} | {load} |" in md  # each run's host and load are recorded


def test_a_resumed_run_is_cross_run_even_within_one_invocation(tmp_path):
    _two_methods(tmp_path, "inv1")
    run_file = tmp_path / "aime24" / "stand" / "run.json"
    info = json.loads(run_file.read_text())
    info["sessions"] += [_session("inv0", 100, 5.0), _session("inv3", 0, 0.1)]  # 0: no work
    run_file.write_text(json.dumps(info))
    stand = next(r for r in report.build(tmp_path)["runs"] if r["method"] == "stand")
    assert stand["speed_vs_plain"]["basis"] == "cross-run"
    assert stand["speed"]["tokens_per_s"] == pytest.approx(500 / 25.0)
    assert [s["invocation"] for s in stand["speed"]["sessions"]] == ["inv1", "inv0"]


def test_plots_name_model_data_and_items_and_keep_methods_apart(tmp_path):
    _two_methods(tmp_path, "inv1")
    data = report.build(tmp_path)
    assert report.caption(data["runs"]) == "model tiny; data fixtures; 4 items"
    styles = report._styles(data)  # markers and widths differ; every curve has its offset
    assert len({s[1] for s in styles.values()}) == len({s[2] for s in styles.values()}) == 2
    shifts = report._shifts(4)
    assert len(set(shifts)) == 4 and shifts == sorted(shifts) and 0.9 < shifts[0] < 1 < shifts[-1]


def test_no_graded_rows_means_no_report(tmp_path):
    assert report.write(tmp_path) == []


def test_interleaved_rounds_of_one_invocation_are_compared(tmp_path):
    _two_methods(tmp_path, "inv1")
    for method, extra in (
        ("stand", _session("inv1", 200, 20.0)),
        ("plain", _session("inv1", 0, 1)),
    ):
        run_file = tmp_path / "aime24" / method / "run.json"
        info = json.loads(run_file.read_text())
        info["sessions"].append(extra)
        run_file.write_text(json.dumps(info))
    stand = next(r for r in report.build(tmp_path)["runs"] if r["method"] == "stand")
    assert stand["speed"]["tokens_per_s"] == 15.0  # 600 tokens over 40 s
    assert stand["speed_vs_plain"] == {"ratio": 1.5, "basis": "same invocation"}


def test_the_report_says_the_whole_wall_its_setup_and_decoding(tmp_path):
    """An invocation that waited 270 s for its models and decoded for 30 s: tokens/s is over
    the 300 s the user waited; the speed-up to plain compares the decoding alone."""
    _two_methods(tmp_path, "inv1")
    run_file = tmp_path / "aime24" / "stand" / "run.json"
    info = json.loads(run_file.read_text())
    info["sessions"] = [_session("inv1", 600, 30.0, setup=270.0)]
    run_file.write_text(json.dumps(info))
    stand = next(r for r in report.build(tmp_path)["runs"] if r["method"] == "stand")
    assert {k: stand["speed"][k] for k in ("wall_s", "setup_s", "decode_s")} == {
        "wall_s": 300.0,
        "setup_s": 270.0,
        "decode_s": 30.0,
    }
    assert stand["speed"]["tokens_per_s"] == 2.0 and stand["speed"]["decode_tokens_per_s"] == 20.0
    assert stand["speed_vs_plain"]["ratio"] == 2.0  # 20 decoding tokens/s over plain's 10
    md = report.markdown(report.build(tmp_path))
    assert "| 2.0 | 20.0 | 300.0 / 270.0 / 30.0 |" in md  # the run's row
    assert "| 300.0 / 270.0 / 30.0 | 2.0 | 20.0 |" in md  # its session's row


def test_sessions_recorded_before_the_split_timed_the_decoding_alone(tmp_path):
    _two_methods(tmp_path, "inv1")
    run_file = tmp_path / "aime24" / "stand" / "run.json"
    info = json.loads(run_file.read_text())
    old = _session("inv0", 100, 5.0)  # wall_s 5.0 and tokens/s 20.0 were the decoding's
    for key in ("setup_s", "decode_s", "decode_tokens_per_s"):
        del old[key]
    info["sessions"] = [old]
    run_file.write_text(json.dumps(info))
    speed = next(r for r in report.build(tmp_path)["runs"] if r["method"] == "stand")["speed"]
    assert (speed["decode_s"], speed["setup_s"], speed["decode_tokens_per_s"]) == (5.0, 0.0, 20.0)


def test_lm_eval_s_layout_is_written_beside_the_report(tmp_path):
    _two_methods(tmp_path, "inv1")
    samples = tmp_path / "aime24" / "stand" / "samples.jsonl"
    lines = [
        {"id": f"q{i}", "index": j, "prompt": "p", "text": f"t{j}", "answer": "1",
         "reference": "1", "correct": j == 0, "finish_reason": "stop", "task": "aime24"}
        for i in range(2) for j in (1, 0)
    ]  # fmt: skip
    samples.write_text("".join(json.dumps(x) + "\n" for x in lines))
    paths = report.write(tmp_path)[4:]
    results = json.loads(paths[0].read_text())
    assert paths[0].parent == tmp_path / "lm-eval" / "tiny"
    assert paths[0].name.startswith("results_") and paths[0].suffix == ".json"
    stand = results["results"]["aime24_stand"]  # two methods ran the task: both kept apart
    assert stand["alias"] == "aime24_stand" and stand["exact_match,none"] == 0.625
    assert stand["maj@2,none"] == 1.0 and stand["exact_match_stderr,none"] >= 0
    assert set(results["results"]) == {"aime24_plain", "aime24_stand"}
    assert results["n-samples"]["aime24_stand"] == {"original": 4, "effective": 4}
    (sample_path,) = paths[1:]  # only the run that logged samples
    assert sample_path.name.startswith("samples_aime24_stand_")
    docs = [json.loads(x) for x in sample_path.read_text().splitlines()]
    assert [d["doc_id"] for d in docs] == [0, 1] and docs[0]["doc"]["id"] == "q0"
    assert docs[0]["resps"] == [["t0", "t1"]] and docs[0]["exact_match"] == 0.5


def test_an_unknown_acceptance_length_is_no_bar_at_zero(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    _two_methods(tmp_path, "inv1")
    rep = report.build(tmp_path)
    rep["runs"][0]["metrics"]["acceptance_length"] = None  # an endpoint's run: no counters
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    report.plot_speed(rep, tmp_path / "speed.png")
    al = saved[0].axes[1]
    assert len(al.patches) == 1  # one bar: the run whose acceptance length is known
    assert [t.get_text() for t in al.texts] == ["unknown"]


def test_lm_eval_s_names_are_the_tasks_as_typed():
    runs = [
        {"task": "gpqa", "method": "auto", "lm_eval_task": "gpqa_diamond", "metrics": None},
        {"task": "aime24", "method": "auto", "metrics": None},  # a run from before: its name
    ]
    metric = {"value": 0.5, "low": 0.4, "high": 0.6}
    for r in runs:
        r["metrics"] = {"n": 2, "pass@1": metric, "maj@n": metric, "pass@n": metric}
    assert set(report.lm_eval_results({"runs": runs})) == {"gpqa_diamond", "aime24"}


def test_tasks_keep_the_name_typed_beside_ours():
    from jobs.evaluate import _tasks

    assert _tasks("gpqa_diamond, aime24,gpqa") == {"gpqa": "gpqa_diamond", "aime24": "aime24"}


def test_a_run_mostly_cut_off_by_the_token_limit_is_warned_at_the_top():
    from tts_service.tasks.report import run_warnings, truncation_warning

    assert truncation_warning(0.2, 512) is None  # at the threshold: not warned
    warning = truncation_warning(0.75, 512)
    assert warning is not None and "75%" in warning and "(512 tokens)" in warning
    assert "sampling.max_new_tokens" in warning
    rates = {"plain": 0.9, "stand": 0.1}
    report = {
        "generated": "now",
        "runs": [
            {"task": "aime24", "method": m, "sampling": {"max_new_tokens": 512},
             "metrics": {"truncation_rate": {"value": rate}}}
            for m, rate in rates.items()
        ],
    }  # fmt: skip
    assert run_warnings(report) == [f"aime24/plain: {truncation_warning(0.9, 512)}"]
