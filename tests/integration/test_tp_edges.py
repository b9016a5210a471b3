"""The edges that run a tensor-parallel replica in their own process (rank 0, the other ranks
Ray actors, gloo, CPU, fp32): `tts solve --tensor-parallel 2` and a Serve engine with
`tensor_parallel: 2` answer what one process answers (greedy), GT-sized methods included, and
refuse rank counts the model's heads do not divide (exit 2, naming the field)."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from tts_service.cli import main
from tts_service.schemas import ServeConfig
from tts_service.serve.api import CompletionRequest
from tts_service.serve.engine import ServeEngine

pytestmark = pytest.mark.slow
QUESTION = "the cat sat on the mat and the cat sat on the"


def _solve_argv(model_dir) -> list[str]:
    return [
        "solve", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
        "--method", "stand", "--temperature", "0", "--max-new-tokens", "12", "--n", "3",
        "--max-rows", "2", "--json", QUESTION,
    ]  # fmt: skip


def test_tensor_parallel_solve_prints_what_one_process_prints(ray_local, tiny_model_dir, capsys):
    argv = _solve_argv(tiny_model_dir)
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--tensor-parallel", "2"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert sharded.keys() == single.keys()
    ids = [[t["token_ids"] for t in p["trajectories"]] for p in sharded["problems"]]
    assert ids == [[t["token_ids"] for t in p["trajectories"]] for p in single["problems"]]
    assert [p["answer"] for p in sharded["problems"]] == [p["answer"] for p in single["problems"]]


@pytest.mark.parametrize("ranks", ["0", "-1", "3"])  # 3 divides neither 4 heads nor 2 KV heads
def test_a_bad_rank_count_is_exit_2_naming_the_flag(tiny_model_dir, capsys, ranks):
    assert main([*_solve_argv(tiny_model_dir), "--tensor-parallel", ranks]) == 2
    assert "tensor" in capsys.readouterr().err


@pytest.mark.parametrize("ranks", ["0", "3"])
def test_tts_serve_refuses_a_bad_rank_count_before_ray(tiny_model_dir, capsys, ranks):
    assert main(["serve", "--model", str(tiny_model_dir), "--tensor-parallel", ranks]) == 2
    assert "tensor" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_dir):
    model = {"name": str(tiny_model_dir), "device": "cpu", "dtype": "float32"}
    single = ServeEngine(ServeConfig(model=model, max_rows=2, default_method="pld"))
    sharded = ServeEngine(
        ServeConfig(model=model, max_rows=2, default_method="pld", tensor_parallel=2)
    )
    yield single, sharded
    sharded.close()


def test_a_tensor_parallel_serve_engine_answers_what_one_process_answers(engines):
    single, sharded = engines
    req = CompletionRequest(prompt=QUESTION, n=2, max_tokens=12, temperature=0, seed=0)
    want = single.complete(single.prepare(req), threading.Event())
    got = sharded.complete(sharded.prepare(req), threading.Event())
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    assert got.keys() == want.keys() and got["usage"] == want["usage"]
    assert not sharded.tp.dead()


def test_a_gt_sized_method_answers_on_a_tensor_parallel_replica(engines):
    """stand-dyn sizes its trees by the fixed GPU-like curve on the ranks: greedy, the same."""
    single, sharded = engines
    req = CompletionRequest(
        prompt=QUESTION, n=1, max_tokens=12, temperature=0, seed=0, spec_method="stand-dyn"
    )
    want = single.complete(single.prepare(req), threading.Event())
    got = sharded.complete(sharded.prepare(req), threading.Event())
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]


def test_a_serve_deployment_with_tensor_parallel_2_answers_over_http(ray_local, engines):
    """The replica is rank 0 in bundle 0 of its STRICT_PACK group, its follower in bundle 1."""
    from ray import serve

    from store.local_server import free_port
    from tts_service.serve.app import build_app

    single, _ = engines
    cfg = ServeConfig(
        model=single.cfg.model, max_rows=2, default_method="pld", tensor_parallel=2,
        cpus_per_replica=0.5, served_model_name="tiny",
    )  # fmt: skip
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(cfg), name="tts-tp", route_prefix="/")
        body = {"model": "tiny", "prompt": QUESTION, "max_tokens": 12, "temperature": 0}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            got = json.loads(resp.read())
    finally:
        serve.delete("tts-tp")
        serve.shutdown()
    want = single.complete(
        single.prepare(CompletionRequest(**{**body, "model": None})), threading.Event()
    )
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
