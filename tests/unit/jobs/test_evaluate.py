"""`jobs.evaluate` input validation: every mistake exits 2 with one line, before any actor."""

from __future__ import annotations

import json

import pytest

from jobs.evaluate import main, parse, schedule
from tts_service.drafters.registry import (
    AUTO_FIELDS,
    METHOD_NAMES,
    METHODS,
    device_type,
    resolve_method,
)

FIXTURES = ["--task", "gpqa", "--data", "fixtures"]


def run_name(method: str) -> str:
    """What `--method` names the run on this machine: `auto` keeps its name where its device
    adds fields of its own (a CPU's drawn children), else the method it resolves to."""
    if method == "auto" and AUTO_FIELDS[device_type("auto")]:
        return "auto"
    return resolve_method(method, "auto")


def _fails(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1, err
    for text in expected:
        assert text in err
    return err


def test_flags_override_the_preset_and_items_are_limited(tmp_path):
    (job,) = parse(
        [*FIXTURES, "--out", str(tmp_path), "--method", "pld", "--n", "4", "--limit", "3"]
    )
    assert job.cfg.drafter.kind == METHODS["pld"].kind and job.cfg.n == 4
    assert job.method == "pld" and len(job.items) == 3
    assert job.run_dir == tmp_path / "gpqa" / "pld"
    (job,) = parse([*FIXTURES, "--out", str(tmp_path), "--set", "drafter.num_nodes=8"])
    assert job.method == run_name("auto")  # the default method
    assert job.cfg.drafter.num_nodes == 8  # a --set wins over the method


def test_bad_inputs_exit_2_before_anything_runs(tmp_path, capsys):
    out = str(tmp_path / "out")
    _fails(capsys, ["--task", "mmlu", "--out", out], "--task", "mmlu")
    _fails(capsys, [*FIXTURES, "--out", out, "--method", "medusa"], "medusa", *METHOD_NAMES)
    _fails(capsys, [*FIXTURES, "--out", out, "--limit", "0"], "--limit")
    _fails(capsys, [*FIXTURES, "--out", out, "--n", "0"], "n:")
    _fails(capsys, [*FIXTURES, "--out", out, "--set", "drafter={kind: pld}"], "drafter.kind")
    _fails(capsys, [*FIXTURES, "--out", out, "--set", "early_stop=true"], "early_stop")
    _fails(capsys, [*FIXTURES, "--out", out, "--release", "release_v5"], "--release")
    _fails(capsys, [*FIXTURES, "--out", out, "--data-files", "x.jsonl"], "--data-files")
    _fails(capsys, ["--tasks", "aime24,mmlu", "--out", out], "mmlu", "gpqa_diamond")
    _fails(capsys, ["--tasks", "aime24,lcb", "--out", out, "--data-files", "x"], "one task")
    _fails(capsys, [*FIXTURES, "--out", out, "--api-key", "k"], "--api-key", "--endpoint")
    _fails(capsys, [*FIXTURES, "--out", out, "--endpoint", "host:8000"], "http")
    endpoint = ["--endpoint", "http://127.0.0.1:9/v1"]
    _fails(capsys, [*FIXTURES, "--out", out, "--method", "plain,stand", *endpoint], "give one")
    _fails(capsys, [*FIXTURES, "--out", out, *endpoint], "--endpoint", "127.0.0.1:9")
    _fails(capsys, [*FIXTURES, "--out", out, "--method", "plain,medusa"], "medusa")
    _fails(capsys, [*FIXTURES, "--out", out, "--round-items", "0"], "--round-items")
    _fails(capsys, ["--task", "lcb", "--out", out, "--data-files", "nope.jsonl"], "no such file")
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub"):
        _fails(capsys, [*FIXTURES, "--out", str(bad)], "--out", "is a file")
    assert not (tmp_path / "out").exists()


def test_an_unreachable_dataset_exits_2_saying_how_to_get_it(tmp_path, capsys, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceH4/aime_2024' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    _fails(
        capsys,
        ["--task", "aime24", "--out", str(tmp_path)],
        "HuggingFaceH4/aime_2024",
        "--data-files",
        "HF_TOKEN",
        "--data fixtures",
    )


def test_a_run_directory_resumes_only_with_the_same_settings(tmp_path, capsys):
    (job,) = parse([*FIXTURES, "--out", str(tmp_path), "--n", "4"])
    job.run_dir.mkdir(parents=True)
    (job.run_dir / "run.json").write_text(json.dumps(job.run_info))
    parse([*FIXTURES, "--out", str(tmp_path), "--n", "4", "--limit", "2"])  # same run, fewer
    _fails(capsys, [*FIXTURES, "--out", str(tmp_path), "--n", "8"], "n=4", "another --out")


def test_several_tasks_in_one_run_with_lm_eval_names(tmp_path):
    jobs = parse(
        ["--tasks", "aime24,gpqa_diamond,lcb", "--data", "fixtures", "--out", str(tmp_path)]
    )
    assert [j.task for j in jobs] == ["aime24", "gpqa", "lcb"]
    auto = run_name("auto")  # the default method names the run directory
    assert [j.run_dir for j in jobs] == [tmp_path / t / auto for t in ("aime24", "gpqa", "lcb")]
    assert all(j.cfg is jobs[0].cfg and len(j.items) >= 10 for j in jobs)
    (job,) = parse(["--task", "gpqa_diamond", "--data", "fixtures", "--out", str(tmp_path)])
    assert job.task == "gpqa"  # --task is the same option


@pytest.mark.parametrize(
    "spelled,ours",
    [
        ("gpqa_diamond_zeroshot", "gpqa"),  # lm-eval
        ("gpqa_diamond_cot_zeroshot", "gpqa"),
        ("lighteval|aime24|0|0", "aime24"),  # lighteval
        ("lighteval|gpqa:diamond|0|0", "gpqa"),
        ("extended|lcb:codegeneration|0|0", "lcb"),
        ("gpqa:diamond", "gpqa"),
    ],
)
def test_lm_eval_and_lighteval_task_names(tmp_path, spelled, ours):
    (job,) = parse(["--tasks", spelled, "--data", "fixtures", "--out", str(tmp_path)])
    assert job.task == ours


def test_an_unknown_task_name_is_exit_2_listing_the_known_ones(tmp_path, capsys):
    _fails(capsys, ["--tasks", "mmlu", "--data", "fixtures", "--out", str(tmp_path)], "mmlu")
    _fails(capsys, ["--tasks", "lighteval|mmlu|0|0", "--out", str(tmp_path)], "lighteval|mmlu")


def test_several_methods_run_interleaved_in_rounds_of_alternating_order(tmp_path):
    argv = [*FIXTURES, "--out", str(tmp_path), "--method", "plain,stand", "--limit", "5"]
    jobs = parse([*argv, "--round-items", "2"])
    ids = [i.id for i in jobs[0].items]
    assert [(j.method, [i.id for i in items]) for j, items in schedule(jobs)] == [
        ("plain", ids[:2]),
        ("stand", ids[:2]),
        ("stand", ids[2:4]),
        ("plain", ids[2:4]),
        ("plain", ids[4:]),
        ("stand", ids[4:]),
    ]
    assert [(j.method, len(items)) for j, items in schedule(parse(argv))] == [
        ("plain", 5),
        ("stand", 5),
    ]


@pytest.mark.parametrize("method", sorted(METHOD_NAMES))
def test_every_registered_method_is_accepted(tmp_path, method):
    (job,) = parse([*FIXTURES, "--out", str(tmp_path), "--method", method])
    assert job.method == run_name(method)
    assert job.cfg.drafter.kind == METHODS[resolve_method(method, "auto")].kind


def test_auto_and_the_method_it_resolves_to_are_two_runs_where_auto_adds_fields(tmp_path):
    """On a CPU `auto` is `stand-dyn` with drawn children: asked for both, the evaluation runs
    both, each in its own directory, instead of one overwriting the other."""
    out = str(tmp_path)
    jobs = parse(
        [*FIXTURES, "--out", out, "--method", "auto,stand-dyn", "--set", "model.device=cpu"]
    )
    assert [j.method for j in jobs] == ["auto", "stand-dyn"]
    assert jobs[0].cfg.drafter.drawn and not jobs[1].cfg.drafter.drawn
    assert jobs[0].run_dir != jobs[1].run_dir


@pytest.mark.parametrize("module", ["jobs.evaluate", "jobs.best_of_n"])
def test_help_shows_a_whole_description_and_the_defaults(module):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True
    ).stdout
    text = " ".join(out.split())
    assert "as a Ray Job entrypoint (or a plain local run)" in text  # not cut mid-sentence
    assert text.split("options:")[0].rstrip().endswith(".")
    assert "--config CONFIG YAML preset (default: the repository's configs/best_of_16.yaml)" in text
    assert "--out OUT" in text and "(required)" in text
