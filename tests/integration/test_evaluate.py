"""`jobs.evaluate` end to end on the shipped fixtures with a tiny model over a local Ray: the
report files appear, methods run interleaved in one invocation are compared, a re-run resumes
instead of redoing work, and a running Serve app is evaluated through its OpenAI API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.evaluate import main
from tests.integration.conftest import refuse_to_start

pytestmark = pytest.mark.slow


def _run(
    out: Path, model_dir: Path, task: str, method: str, limit: int = 2, *extra, tokens: int = 8
) -> None:
    argv = [
        *extra,
        "--tasks",
        task,
        "--data",
        "fixtures",
        "--method",
        method,
        "--n",
        "2",
        "--limit",
        str(limit),
        "--out",
        str(out),
        "--set",
        f"model.name={model_dir}",
        "--set",
        "model.device=cpu",
        "--set",
        "model.dtype=float32",
        "--set",
        f"sampling.max_new_tokens={tokens}",
        "--set",
        "batch=2",
        "--set",
        "replicas=1",
        "--set",
        "cpus_per_replica=1",
    ]
    assert main(argv) == 0


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_evaluation_writes_the_report_and_a_rerun_resumes(ray_local, tiny_model_dir, tmp_path):
    out = tmp_path / "eval"
    _run(out, tiny_model_dir, "aime24", "plain,stand", 2, "--round-items", "1", "--log-samples")
    _run(out, tiny_model_dir, "lcb", "stand")
    for name in ("report.json", "report.md", "accuracy_vs_n.png", "speed.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    runs = {(r["task"], r["method"]): r for r in report["runs"]}
    assert set(runs) == {("aime24", "stand"), ("aime24", "plain"), ("lcb", "stand")}
    assert runs[("aime24", "plain")]["metrics"]["acceptance_length"]["value"] == 1.0
    versus = runs[("aime24", "stand")]["speed_vs_plain"]
    assert versus["basis"] == "same invocation" and versus["ratio"] > 0
    sessions = runs[("aime24", "stand")]["speed"]["sessions"]
    assert len(sessions) == 2 and len({s["invocation"] for s in sessions}) == 1  # two rounds
    assert all(s["host"] and len(s["loadavg_start"]) == 3 for s in sessions)
    for key in ("no_answer_rate", "truncation_rate"):
        assert 0 <= runs[("aime24", "stand")]["metrics"][key]["value"] <= 1
    samples = [json.loads(x) for x in _lines(out / "aime24" / "stand" / "samples.jsonl")]
    assert sorted((s["id"], s["index"]) for s in samples) == [
        ("1", 0),
        ("1", 1),
        ("2", 0),
        ("2", 1),
    ]
    assert all(s["prompt"] and "text" in s and "answer" in s and "correct" in s for s in samples)
    assert report["sandbox"]["kill_on_timeout"]
    stand = out / "aime24" / "stand"
    rows = [json.loads(line) for line in _lines(stand / "items.jsonl")]
    # rows are written as items finish; an actor's concurrent calls may finish item 2 first
    ids = sorted(r["id"] for r in rows)
    assert ids == ["1", "2"] and all(len(r["correct"]) == 2 for r in rows)
    assert "| stand |" in (out / "report.md").read_text()

    # a crash after the first item and one trajectory of the second: redo only what is missing
    trajectories = _lines(stand / "trajectories.jsonl")
    item_one = next(r for r in _lines(stand / "items.jsonl") if json.loads(r)["id"] == "1")
    (stand / "items.jsonl").write_text(item_one + "\n")
    kept = [t for t in trajectories if json.loads(t)["problem_id"] == "1"]
    kept.append(next(t for t in trajectories if json.loads(t)["problem_id"] == "2"))
    (stand / "trajectories.jsonl").write_text("\n".join(kept) + "\n")
    _run(out, tiny_model_dir, "aime24", "stand")
    after = _lines(stand / "trajectories.jsonl")
    assert after[:3] == kept and len(after) == 4  # one trajectory redone, none doubled
    assert [json.loads(r)["id"] for r in _lines(stand / "items.jsonl")] == ["1", "2"]  # 1 kept
    report = json.loads((out / "report.json").read_text())
    stand_run = next(r for r in report["runs"] if r["method"] == "stand" and r["task"] == "aime24")
    assert stand_run["speed_vs_plain"] == {"ratio": None, "basis": "cross-run"}  # resumed apart
    assert "cross-run: not compared" in (out / "report.md").read_text()

    # a finished run is not redone; a larger --limit runs only the new item
    _run(out, tiny_model_dir, "aime24", "stand")
    assert _lines(stand / "trajectories.jsonl") == after
    _run(out, tiny_model_dir, "aime24", "stand", limit=3)
    assert (
        len(_lines(stand / "items.jsonl")) == 3 and len(_lines(stand / "trajectories.jsonl")) == 6
    )


def test_three_tasks_and_two_methods_load_the_model_once_and_beat_while_decoding(
    ray_local, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """One set of actors serves every task and method of an evaluation (the method travels
    with each call), and a decoding job says how it is doing between finished trajectories."""
    monkeypatch.setattr("jobs.heartbeat.HEARTBEAT_S", 0.05)
    out = tmp_path / "eval"
    _run(
        out,
        tiny_model_dir,
        "aime24,gpqa,lcb",
        "plain,stand",
        1,
        "--set",
        "confidence=true",
        tokens=64,
    )
    captured = capsys.readouterr()
    log = captured.out + captured.err
    assert log.count("[job] starting 1 actor(s)") == 1, log
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert {(r["task"], r["method"]) for r in runs} == {
        (t, m) for t in ("aime24", "gpqa", "lcb") for m in ("plain", "stand")
    }
    accepted = {(r["task"], r["method"]): r["metrics"]["acceptance_length"]["value"] for r in runs}
    for r in runs:  # the same samples by the confidence-weighted and the filtered vote
        assert 0 <= r["metrics"]["confidence_maj@n"]["value"] <= 1
        assert 0 <= r["metrics"]["filtered_maj@n"]["value"] <= 1
    assert "confidence-weighted maj@N" in (out / "report.md").read_text()
    assert all(accepted[(t, "plain")] == 1.0 for t in ("aime24", "gpqa", "lcb"))  # per call
    top = (out / "report.md").read_text().splitlines()[4]  # every answer cut at 64 tokens
    assert top.startswith("> **Warning**: aime24/plain: 100% of trajectories stopped at")
    assert "[eval] warning: lcb/stand: 100% of trajectories" in log
    beats = [line for line in log.splitlines() if line.startswith("[job] decoding")]
    assert beats and all("tok/s" in b and "trajectories" in b for b in beats), log


def test_a_rerun_with_nothing_missing_starts_neither_ray_nor_a_model(
    ray_local, tiny_model_dir, tmp_path, monkeypatch
):
    """Graded items are skipped, and items whose trajectories are all written are graded from
    them, without Ray or a model; the report says the whole wall, its setup and decoding."""
    out = tmp_path / "eval"
    _run(out, tiny_model_dir, "aime24", "plain", 1)
    speed = json.loads((out / "report.json").read_text())["runs"][0]["speed"]
    assert 0 < speed["decode_s"] < speed["wall_s"]
    assert speed["setup_s"] == pytest.approx(speed["wall_s"] - speed["decode_s"], abs=0.02)
    assert speed["tokens_per_s"] < speed["decode_tokens_per_s"]
    run_dir = out / "aime24" / "plain"
    graded = (run_dir / "items.jsonl").read_text()
    started = refuse_to_start(monkeypatch)
    _run(out, tiny_model_dir, "aime24", "plain", 1)  # every item graded
    (run_dir / "items.jsonl").unlink()  # a crash after the last trajectory, before grading
    _run(out, tiny_model_dir, "aime24", "plain", 1)
    assert started == [] and (run_dir / "items.jsonl").read_text() == graded


@pytest.fixture(scope="module")
def serve_app(ray_local, tiny_model_dir):
    """A Serve app of `tts serve`'s build on the local Ray, over real HTTP."""
    from ray import serve

    from store.local_server import free_port
    from tts_service.schemas import ServeConfig
    from tts_service.serve.app import build_app

    port = free_port()
    cfg = ServeConfig(
        model={"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"},
        served_model_name="tiny-served",
        cpus_per_replica=0.5,
        max_tokens_cap=64,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="tts-eval", route_prefix="/")
    yield f"http://127.0.0.1:{port}/v1"
    serve.delete("tts-eval")
    serve.shutdown()


def test_a_running_serve_app_is_evaluated_over_its_openai_api(serve_app, tmp_path):
    out = tmp_path / "eval"
    argv = ["--tasks", "aime24,gpqa_diamond", "--data", "fixtures", "--n", "2", "--limit", "2"]
    argv += ["--endpoint", serve_app, "--log-samples", "--out", str(out)]
    assert main([*argv, "--set", "sampling.max_new_tokens=8"]) == 0
    report = json.loads((out / "report.json").read_text())
    runs = {(r["task"], r["method"]): r for r in report["runs"]}
    assert set(runs) == {("aime24", "endpoint"), ("gpqa", "endpoint")}
    for run in runs.values():
        assert run["model"] == "tiny-served" and run["endpoint"] == serve_app
        assert run["metrics"]["items"] == 2 and run["metrics"]["acceptance_length"] is None
        assert run["metrics"]["truncation_rate"]["value"] > 0.5  # 8 tokens rarely finish
        assert run["speed"]["tokens_per_s"] > 0
        samples = _lines(out / run["task"] / "endpoint" / "samples.jsonl")
        assert len(samples) == 4 and all(
            json.loads(x)["finish_reason"] == "length" for x in samples
        )
    md = (out / "report.md").read_text()
    assert f"generated by endpoint {serve_app}" in md and "| endpoint | 2 | 2 |" in md
