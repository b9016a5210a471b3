"""`tts job` parsing: options follow their action, help never submits, a missing id is exit 2,
the entrypoint after `--` is passed whole. (The Ray job server itself: tests/integration.)"""

from __future__ import annotations

import json

import pytest

from store.local_server import free_port
from tts_service.cli import main, make_parser
from tts_service.cli.job import entrypoint


def test_results_takes_out_after_the_action(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"problems": 3}))
    assert main(["job", "results", "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out) == {"problems": 3}
    assert main(["job", "results", "--out", str(tmp_path / "missing")]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["status", "logs", "stop"])
def test_address_and_flags_follow_the_action(action):
    args = make_parser().parse_args(["job", action, "--address", "http://h:1", "raysubmit_7"])
    assert (args.action, args.address, args.job_id) == (action, "http://h:1", "raysubmit_7")
    args = make_parser().parse_args(["job", "logs", "raysubmit_7", "--follow"])
    assert args.follow and args.job_id == "raysubmit_7"
    assert make_parser().parse_args(["job", "list", "--address", "http://h:1"]).address


@pytest.mark.parametrize("action", ["status", "logs", "stop"])
def test_a_missing_job_id_is_exit_2_naming_it(action, capsys):
    assert main(["job", action]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "job_id" in err


@pytest.mark.parametrize(
    "argv,shows",
    [(["job", "submit", "--help"], "--working-dir"), (["job", "--help"], "logs,stop,list")],
)
def test_help_prints_help_and_submits_nothing(argv, shows, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tts job") and shows in out


def test_the_entrypoint_after_the_separator_is_passed_whole_help_included():
    argv = ["job", "submit", "--address", "http://h:1", "--working-dir", "/w", "--"]
    entry = ["python", "-m", "jobs.best_of_n", "--out", "a b", "--help"]
    args = make_parser().parse_args(argv + entry)
    assert (args.address, args.working_dir) == ("http://h:1", "/w")
    assert entrypoint(args) == "python -m jobs.best_of_n --out 'a b' --help"


def test_submit_without_an_entrypoint_is_exit_2(capsys):
    assert main(["job", "submit", "--"]) == 2
    assert "entrypoint" in capsys.readouterr().err


def test_an_unreachable_job_server_is_exit_2_naming_the_address(capsys):
    address = f"http://127.0.0.1:{free_port()}"
    assert main(["job", "status", "--address", address, "raysubmit_1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--address" in err and address in err
