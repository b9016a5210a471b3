"""`tts replay`: bad log lines are skipped (or, with --strict, rejected) naming their line, and
a bad method exits 2."""

from __future__ import annotations

import json

from tts_service.cli import main
from tts_service.replay import LoggedProblem


def test_replay_cli_skips_or_rejects_bad_lines(tmp_path, capsys):
    good = LoggedProblem("ok", [5, 6, 7, 8], [[5, 6, 7, 8]])
    path = tmp_path / "log.jsonl"
    path.write_text(good.to_json() + "\n" + '{"prompt_id": 1}\n')
    assert main(["replay", "--method", "pld", "--trajectories", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["acceptance_length"] == 2.0 and report["skipped_lines"] == 1
    assert f"{path}:2" in err
    assert main(["replay", "--method", "pld", "--trajectories", str(path), "--strict"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{path}:2" in err and err.count("\n") == 1
    assert main(["replay", "--method", "medusa", "--trajectories", str(path)]) == 2
    assert "--method" in capsys.readouterr().err
