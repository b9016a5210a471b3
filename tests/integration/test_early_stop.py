"""The exact early stop in flight, with the real SmolLM2 (greedy: its trajectories agree):
`tts solve`'s path stops a decided problem's other rows and votes as all N would; a job cancels
the rows it has in flight on its actor, records which were cut, and a re-run does not redo
them; `/v1/solve` answers `decoded k of N` with the answer it gives without early stop."""

from __future__ import annotations

import json

import pytest

from store.memory import InMemoryNgramStore
from tts_service.aggregate.early_stop import EarlyStop
from tts_service.config import SamplingConfig
from tts_service.drafters.stand import StandDrafterConfig
from tts_service.runner import TrajectoryRunner
from tts_service.schemas import JobConfig, Problem
from tts_service.solve import ProblemInput, solve_problems

pytestmark = pytest.mark.slow
QUESTION = "What is 7 * 6?"
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=48)


def _solve(smollm2, early_stop: EarlyStop | None) -> dict:
    ids = smollm2.encode(QUESTION, chat=True)
    problem = ProblemInput("q", ids, InMemoryNgramStore())
    runner = TrajectoryRunner(smollm2, max_rows=2)  # 2 rows: the third waits for a slot
    solved = solve_problems(
        runner, [problem], 3, StandDrafterConfig(), GREEDY, early_stop=early_stop
    )
    return solved.to_dict("math")["problems"][0]


def test_a_decided_problem_stops_its_waiting_rows_and_votes_as_all_n(smollm2):
    full = _solve(smollm2, None)
    early = _solve(smollm2, EarlyStop(3, "math", in_thread=False))  # decided before the next step
    assert full["answer"] is not None and len(full["trajectories"]) == 3
    assert early["stopped_early"] and (early["decoded"], early["n"]) == (2, 3)
    assert early["answer"] == full["answer"]  # 2 agreeing of 3: the third cannot change it
    assert early["stats"]["new_tokens"] < full["stats"]["new_tokens"]
    assert [t["index"] for t in early["trajectories"]] == [0, 1]


def test_a_job_cancels_the_rows_in_flight_and_a_rerun_keeps_the_cut(ray_local, tmp_path):
    """One plain row at a time, so the vote is decided by the first two to finish while the
    third's call is in flight with all its forwards to go. With two rows the third started when
    the first finished, beside the second, and drafting from their identical greedy text it
    caught up and finished with the second, before the cancel could land."""
    from jobs.best_of_n import run as run_job

    cfg = JobConfig.model_validate(
        {
            "model": {"name": "smollm2-135m", "device": "cpu", "dtype": "float32"},
            "sampling": {"temperature": 0.0, "max_new_tokens": 48},
            "drafter": {"kind": "plain"},
            "n": 3,
            "max_rows": 1,
            "replicas": 1,
            "cpus_per_replica": 1,
            "early_stop": True,
        }
    )
    problem = Problem(id="p", question=QUESTION, answer="42")
    out = tmp_path / "out"
    run_job(cfg, [problem], out)
    result = json.loads((out / "problems" / "p.json").read_text())
    assert result["stopped_early"] and result["decoded"] == 2 and len(result["cut"]) == 1
    ran = [
        json.loads(line)["index"] for line in (out / "trajectories.jsonl").read_text().splitlines()
    ]
    assert sorted(ran + result["cut"]) == [0, 1, 2]  # the cut one never ran to its end
    run_job(cfg, [problem], out)  # resumed: the decided problem is not run again
    again = json.loads((out / "problems" / "p.json").read_text())
    assert again["cut"] == result["cut"] and again["answer"] == result["answer"]
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == 2


def test_a_cancelled_problem_s_call_returns_at_its_next_step(ray_local):
    """The actor's side of a job's early stop: a long call (ignore_eos, 2,000 tokens: minutes
    here) returns what finished, nothing, soon after `cancel` names its problem."""
    import time

    import ray

    from actors.pool import start_actors

    cfg = JobConfig.model_validate(
        {
            "model": {"name": "smollm2-135m", "device": "cpu", "dtype": "float32"},
            "sampling": {"temperature": 0.0, "max_new_tokens": 2000, "ignore_eos": True},
            "replicas": 1,
            "cpus_per_replica": 1,
        }
    )
    (actor,) = start_actors(cfg, 1, None)
    try:
        call = actor.run.remote("job", "p", QUESTION, [0, 1])
        time.sleep(2.0)  # decoding
        ray.get(actor.cancel.remote("job", "p"), timeout=30)  # answered beside the run
        assert ray.get(call, timeout=60) == []  # long before 2,000 tokens
    finally:
        ray.kill(actor)


@pytest.fixture(scope="module")
def smollm2_app(ray_local):
    from ray import serve

    from store.local_server import free_port
    from tts_service.schemas import ServeConfig
    from tts_service.serve.app import build_app

    port = free_port()
    cfg = ServeConfig(
        model={"name": "smollm2-135m", "device": "cpu", "dtype": "float32"},
        cpus_per_replica=0.5,
        max_rows=2,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="tts-early-stop", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("tts-early-stop")
    serve.shutdown()  # the next module's Serve starts on its own port


def test_v1_solve_stops_a_decided_vote_with_the_same_answer(smollm2_app):
    import urllib.request

    def solve(early_stop: bool) -> dict:
        body = {"question": QUESTION, "n": 3, "temperature": 0.0, "max_tokens": 48}
        req = urllib.request.Request(
            smollm2_app + "/v1/solve",
            data=json.dumps(body | {"early_stop": early_stop}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    full, early = solve(False), solve(True)
    assert (full["decoded"], full["stopped_early"]) == (3, False)
    assert early["stopped_early"] and early["decoded"] < early["n"] == 3
    assert early["answer"] == full["answer"] is not None
    assert early["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
