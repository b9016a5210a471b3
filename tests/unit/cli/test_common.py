"""CLI boundary: bad input exits 2 with one line naming the field and prints nothing to stdout."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import BaseModel

from store.local_server import free_port
from tts_service.cli import main, make_parser
from tts_service.cli.common import request
from tts_service.schemas import CalibrateTreeRequest, GenerateRequest, SolveRequest

BAD = [
    (["generate", ""], "--prompt"),
    (["generate", "   "], "--prompt"),
    (["generate", "--max-new-tokens", "0", "hi"], "--max-new-tokens"),
    (["generate", "--max-new-tokens", "1000000000000", "hi"], "--max-new-tokens"),  # no model load
    (["generate", "--temperature", "-0.1", "hi"], "--temperature"),
    (["generate", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--top-p", "1.01", "hi"], "--top-p"),
    (["generate", "--method", "medusa", "hi"], "--method"),
    (["generate", "--temperature", "warm", "hi"], "--temperature"),
    (["generate", "--seed", "-3", "hi"], "--seed"),
    (["generate", "--method", "recycle", "--num-nodes", "0", "hi"], "--num-nodes"),
    (["generate", "--method", "recycle", "--tree", "nope", "hi"], "--tree"),
    (["generate", "--method", "ptd", "--num-nodes", "8", "hi"], "--num-nodes"),  # no size field
    (["generate", "--method", "plain", "--num-nodes", "8", "hi"], "--num-nodes"),
    (["generate", "--method", "pld", "--num-nodes", "65", "hi"], "--num-nodes"),  # PLD: <= 64
    (["generate", "--method", "pld", "--tree", "stand-80", "hi"], "--tree"),
    (["generate", "--method", "goose", "--deterministic", "hi"], "--deterministic"),
    (["generate", "--method", "pld", "--harvest-rejected", "hi"], "--harvest-rejected"),
    (["generate", "--method", "pld", "--no-harvest-rejected", "hi"], "--no-harvest-rejected"),
    (["generate", "--dtype", "int8", "hi"], "--dtype"),
    (["generate", "--config", "/no/such.yaml", "hi"], "--config"),
    (["generate", "--stop", "", "hi"], "--stop"),
    (["generate"], "prompt"),
    (["solve"], "--problems"),
    (["solve", "--problems", "/no/such.jsonl"], "--problems"),
    (["solve", "--problems", "jobs/demo_problems.jsonl", "also a question"], "--problems"),
    (["solve", "--max-rows", "0", "q"], "--max-rows"),
    (["solve", "--task", "poetry", "q"], "--task"),
    (["solve", "--store", "foo://x", "q"], "--store"),  # the flag, not the field (url)
    (["frobnicate"], "frobnicate"),
    (["generate", "--device", "tpu", "hi"], "--device"),
    (["generate", "--device", "cuda:x", "hi"], "--device"),
]


@pytest.mark.parametrize("argv,field", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_naming_the_field(argv, field, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and field in err


@pytest.mark.parametrize(
    "argv,allowed",
    [
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (
            ["--dtype", "int8"],
            "Input should be 'auto', 'float32', 'float64', 'bfloat16' or 'float16'",
        ),
    ],
)
def test_a_bad_device_or_dtype_lists_the_allowed_values(argv, allowed, capsys):
    assert main(["generate", *argv, "hi"]) == 2
    assert capsys.readouterr().err == f"tts: error: {argv[0]}: {allowed}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_exit_2_before_the_load(capsys):
    assert main(["generate", "--device", "cuda", "--model", "no-such-org/no-such-model", "hi"]) == 2
    assert "--device: device 'cuda' requested but CUDA is not available" in capsys.readouterr().err


def test_an_unreachable_store_is_reported_before_the_model_loads(capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    argv = ["solve", "--model", "no-such-org/no-such-model", "--store", url, "q"]
    assert main(argv) == 2  # the store's error, not the missing model's: it was checked first
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"tts: error: --store: cannot reach Redis at {url}")


def test_unknown_model_exits_2_from_a_real_process():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tts_service",
            "generate",
            "--model",
            "no-such-org/no-such-model",
            "hello",
        ],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": ""},
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--model" in proc.stderr and "no-such-org/no-such-model" in proc.stderr


def test_auto_is_the_one_default_method(tmp_path):
    from pathlib import Path

    from jobs.best_of_n import parse as best_of_n
    from jobs.evaluate import parse as evaluate
    from tts_service.config import load_yaml
    from tts_service.drafters.registry import (
        AUTO_FIELDS,
        DEFAULT_METHOD,
        METHODS,
        device_type,
        resolve_method,
    )
    from tts_service.schemas import ServeConfig

    assert DEFAULT_METHOD == "auto"
    runs = METHODS[resolve_method("auto", "auto")]
    repo = Path(__file__).resolve().parents[3]
    assert load_yaml(repo / "configs/default.yaml")["method"] == DEFAULT_METHOD
    assert load_yaml(repo / "configs/best_of_16.yaml")["method"] == DEFAULT_METHOD
    serve = load_yaml(repo / "configs/serve.yaml")["applications"][0]["args"]
    assert serve["default_method"] == ServeConfig().default_method == DEFAULT_METHOD
    req = request(make_parser().parse_args(["generate", "hi"]), GenerateRequest, {"prompt": "hi"})
    assert req.drafter.kind == runs.kind
    cfg, _, _ = best_of_n(
        ["--problems", str(repo / "jobs/demo_problems.jsonl"), "--out", str(tmp_path)]
    )
    assert cfg.drafter.kind == runs.kind
    (job,) = evaluate(["--task", "gpqa", "--data", "fixtures", "--out", str(tmp_path)])
    # named after what it resolves to, or `auto` where the device adds fields (a CPU's drawn)
    own = AUTO_FIELDS[device_type("auto")]
    assert job.method == ("auto" if own else resolve_method("auto", "auto"))


def _subparser(*names: str):
    parser = make_parser()
    for name in names:
        parser = next(a for a in parser._actions if a.dest in ("command", "action")).choices[name]
    return parser


def _effective_requests():
    """What each command runs with when given no flags: the preset and the schema decide."""
    gen = request(make_parser().parse_args(["generate", "hi"]), GenerateRequest, {"prompt": "hi"})
    sol = request(make_parser().parse_args(["solve", "q"]), SolveRequest, {"question": "q"})
    cal = CalibrateTreeRequest(prompts="configs/calibration.jsonl", out="x.json")
    return {"generate": gen, "solve": sol, "calibrate-tree": cal}


@pytest.mark.parametrize("command", ["generate", "solve", "calibrate-tree"])
def test_every_flag_with_a_schema_default_shows_it_in_help(command):
    req = _effective_requests()[command]
    shown = set()
    for action in _subparser(command)._actions:
        dest = action.dest
        if not action.option_strings:
            continue  # the prompt or question itself
        for owner in (req, req.sampling, req.model):
            if dest in type(owner).model_fields and not (owner is req and dest == "model"):
                value = getattr(owner, dest)
                break
        else:
            value = req.model.name if dest == "model" else None
        if value in (None, ()) or isinstance(value, bool | BaseModel) or action.default:
            continue  # no scalar default to show, or argparse's own (shown by %(default)s)
        assert f"(default: {value})" in action.help, (dest, action.help)
        shown.add(dest)
    assert {"temperature", "max_new_tokens", "seed", "model"} <= shown
    if command != "calibrate-tree":
        assert {"top_p", "top_k", "device", "dtype"} <= shown


def test_store_actions_have_their_own_help(capsys):
    with pytest.raises(SystemExit):
        main(["store", "stats", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: tts store stats") and "--scope" in out


@pytest.mark.parametrize(
    "method,field", [("recycle", "num_nodes"), ("pld", "num_draft_tokens"), ("gtcp", "max_nodes")]
)
def test_num_nodes_sets_the_methods_size_field(method, field):
    from tts_service.drafters.registry import size_field

    argv = ["generate", "--method", method, "--num-nodes", "7", "hi"]
    req = request(make_parser().parse_args(argv), GenerateRequest, {"prompt": "hi"})
    assert size_field(req.drafter.kind) == field and getattr(req.drafter, field) == 7


@pytest.mark.parametrize(
    "flags,harvest",
    [([], True), (["--no-harvest-rejected"], False), (["--harvest-rejected"], True)],
)
def test_stand_dyn_harvests_rejected_nodes_unless_told_not_to(flags, harvest):
    for method in ("stand-dyn", "auto"):
        argv = ["generate", "--method", method, *flags, "hi"]
        req = request(make_parser().parse_args(argv), GenerateRequest, {"prompt": "hi"})
        assert req.drafter.kind == "stand_dyn" and req.drafter.harvest_rejected is harvest
