"""Best-of-N through Redis with the real SmolLM2: faults never change the output, and a second
process learns from the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from store.config import StoreConfig
from store.factory import open_problem_store, problem_id
from store.local_server import LocalRedisServer
from store.memory import InMemoryNgramStore
from tts_service.config import SamplingConfig
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.solve import solve

pytestmark = pytest.mark.slow

QUESTION = "List the even numbers from 2 to 20, then add them up step by step."
GREEDY = SamplingConfig(temperature=0, max_new_tokens=48)
STAND = StandDrafterConfig(num_nodes=16)


def test_kill_9_of_redis_mid_solve_changes_nothing_and_is_recorded(smollm2):
    ids = smollm2.encode(QUESTION, chat=True)
    expect = solve(smollm2, ids, 3, STAND, GREEDY, InMemoryNgramStore()).problems[0]
    with LocalRedisServer() as server:
        cfg = StoreConfig(close_timeout_s=0.5)  # solve closes the store: Redis stays dead
        store = open_problem_store(cfg, server.url, problem_id(ids))

        def crash_after_first(traj) -> None:
            if traj.index == 0:
                server.kill()

        got = solve(
            smollm2, ids, 3, STAND, GREEDY, store, on_trajectory=crash_after_first
        ).problems[0]
    assert [t.output.token_ids for t in got.trajectories] == [
        t.output.token_ids for t in expect.trajectories
    ]
    stats = got.store_stats
    assert stats["degraded"] and stats["fallbacks"] == 1 and stats["errors"] >= 1
    assert stats["lost_updates"] > 0 and stats["pending_updates"] == 0  # reported, not pending
    assert got.trajectories[2].output.stats.acceptance_length > 1.5  # the local cache served


def _solve_cli(url: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TTS_STORE_URL": url}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tts_service",
            "solve",
            "--method",
            "stand",
            "--n",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "48",
            "--json",
            QUESTION,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_a_second_process_learns_from_the_first_through_redis():
    with LocalRedisServer() as server:
        first = _solve_cli(server.url)
        second = _solve_cli(server.url)
    first, second = first["problems"][0], second["problems"][0]
    a1 = first["trajectories"][0]["stats"]["acceptance_length"]
    a2 = second["trajectories"][0]["stats"]["acceptance_length"]
    assert first["trajectories"][0]["token_ids"] == second["trajectories"][0]["token_ids"]
    assert a2 > a1 + 0.5, (a1, a2)
    assert second["stats"]["store"]["backend"] == "redis"
