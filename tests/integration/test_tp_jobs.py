"""Best-of-N jobs whose replicas are tensor-parallel (2 rank actors, gloo, CPU, fp32): greedy
trajectories equal one process's plain decoding, and a rank killed mid-job (a follower, or rank
0) restarts the replica as a whole while every trajectory is still written exactly once."""

from __future__ import annotations

import json

import pytest

from actors.pool import ResultsFile, TrajectoryPool, close_actors, kill_replicas, start_replicas
from jobs.best_of_n import main as job_main
from jobs.best_of_n import run as run_job
from tts_service.config import ModelConfig
from tts_service.engine.decode import plain_generate
from tts_service.generation import Generator
from tts_service.schemas import JobConfig, Problem

pytestmark = pytest.mark.slow
PROBLEM = Problem(id="p1", question="What is 1 + 1? Put the answer in \\boxed{}.", answer="2")


def _cfg(model_dir, **kw) -> JobConfig:
    base = {
        "model": {"name": str(model_dir), "device": "cpu", "dtype": "float32"},
        "drafter": {"kind": "stand", "num_nodes": 8},
        "sampling": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
        "n": 4,
        "batch": 1,
        "replicas": 1,
        "tensor_parallel": 2,
        "cpus_per_replica": 0.5,
    }
    return JobConfig.model_validate({**base, **kw})


@pytest.fixture(scope="module")
def greedy_ids(tiny_model_dir) -> list[int]:
    """What one process decodes plainly for the problem (the chat template, as jobs use)."""
    gen = Generator.load(ModelConfig(name=str(tiny_model_dir), device="cpu", dtype="float32"))
    ids = gen.encode(PROBLEM.question, chat=True)
    sampling = _cfg(tiny_model_dir).sampling
    return list(plain_generate(gen.loaded.model, ids, sampling, gen.loaded.eos_token_ids).token_ids)


def test_a_best_of_4_job_on_a_two_rank_replica_equals_one_process(
    ray_local, tiny_model_dir, tmp_path, greedy_ids
):
    out = tmp_path / "out"
    summary = run_job(_cfg(tiny_model_dir, batch=2), [PROBLEM], out)
    assert summary["trajectories"] == 4 and summary["retries"] == 0
    result = json.loads((out / "problems" / "p1.json").read_text())
    assert [t["index"] for t in result["trajectories"]] == [0, 1, 2, 3]
    assert all(t["token_ids"] == greedy_ids for t in result["trajectories"])
    # four equal greedy trajectories: one answer (a random model's: none), which the vote is
    answers = {t["answer"] for t in result["trajectories"]}
    assert answers == {result["answer"]}


@pytest.mark.parametrize("rank", [1, 0], ids=["follower", "rank0"])
def test_killing_a_rank_mid_job_restarts_the_replica_and_loses_nothing(
    ray_local, tiny_model_dir, tmp_path, greedy_ids, rank
):
    # one row at a time: trajectories finish one by one, so the kill lands with work in flight
    cfg = _cfg(tiny_model_dir, max_rows=1)
    replicas = start_replicas(cfg, 1, None)
    results = ResultsFile(tmp_path / "trajectories.jsonl")
    pool = TrajectoryPool(cfg, replicas, "tp-kill", results)
    killed = []

    def kill_once(rec: dict) -> None:
        if not killed:
            killed.append(rec)
            ray_local.kill(replicas[0].ranks[rank])

    try:
        states = pool.run([PROBLEM], on_trajectory=kill_once)
        close_actors(replicas)
    finally:
        kill_replicas(replicas)
    recs = [json.loads(line) for line in results.path.read_text().splitlines()]
    assert sorted(r["index"] for r in recs) == [0, 1, 2, 3]  # each exactly once
    assert sorted(states["p1"].records) == [0, 1, 2, 3]
    assert all(r["token_ids"] == greedy_ids for r in recs)
    assert replicas[0].restarts == 1 and pool.retries >= 1


@pytest.mark.parametrize(("value", "field"), [("0", "tensor_parallel"), ("3", "tensor_parallel")])
def test_a_bad_tensor_parallel_is_exit_2_before_any_actor(
    tiny_model_dir, tmp_path, capsys, value, field
):
    problems = tmp_path / "p.jsonl"
    problems.write_text(PROBLEM.model_dump_json() + "\n")
    argv = [
        "--problems", str(problems), "--out", str(tmp_path / "o"),
        "--set", f"model.name={tiny_model_dir}", "--set", "model.device=cpu",
        "--method", "stand", "--set", f"tensor_parallel={value}",
    ]  # fmt: skip
    assert job_main(argv) == 2
    assert f"{field}:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_gpu_plan_makes_replicas_tensor_parallel_on_declared_gpus(
    ray_local, tiny_model_dir, tmp_path, greedy_ids
):
    """The session's Ray declares 8 GPUs; a GPU of 0.012 GiB holds half the tiny model (12.7
    MB of fp32 weights, 0.5 MB of KV cache): the plan makes each replica 2 ranks of a GPU
    each, GT-sized methods included (their ranks price trees by the fixed curve)."""
    from jobs.actor_set import placed_actors

    plan = {
        "model": {"name": str(tiny_model_dir), "device": "auto", "dtype": "float32"},
        "tensor_parallel": 1,
        "gpu_memory_gb": 0.012,
        "max_rows": 2,
        "n": 2,
    }
    placed, replicas, gpus, strategies = placed_actors(_cfg(tiny_model_dir, **plan))
    assert (placed.tensor_parallel, replicas, gpus, strategies) == (2, 1, 1, [])
    gt = {"kind": "stand", "num_nodes": 8, "sizing": "gt"}
    assert placed_actors(_cfg(tiny_model_dir, **plan, drafter=gt))[0].tensor_parallel == 2
    actors = start_replicas(placed, replicas, None, gpus)
    try:
        ids = ray_local.get(
            [r.__ray_call__.remote(lambda self: ray_local.get_gpu_ids()) for r in actors[0].ranks]
        )
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 2
        pool = TrajectoryPool(placed, actors, "tp-gpu", ResultsFile(tmp_path / "t.jsonl"))
        states = pool.run([PROBLEM])
        close_actors(actors)
    finally:
        kill_replicas(actors)
    assert [states["p1"].records[i]["token_ids"] for i in (0, 1)] == [greedy_ids] * 2
