"""Decoding over a shared Redis store, with a tiny seeded model: two actors sharing a scope at
once decode exactly what plain decoding does (greedy), and the verify-key ledger never fails
open: a sampling row whose key its store has not confirmed yet (a server that has not answered,
here one stopped with SIGSTOP) decodes plain steps, and drafts once the server answers."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
from pydantic import TypeAdapter

from store.base import NgramRow
from store.redis_store import RedisLogitNgramStore, RedisScope
from tests.conftest import FLAT_COST, save_tiny_model
from tests.unit.engine.test_allocate import FLAT
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import DrafterConfig, method_drafter
from tts_service.engine.cost import CostModel
from tts_service.generation import Generator
from tts_service.models import load_model
from tts_service.runner import TrajectoryRunner
from tts_service.solve import ProblemInput, solve_problems

VOCAB = 8
QUESTION = "w3 w5 w1 w3 w5"


@pytest.fixture(scope="module")
def generator(tmp_path_factory) -> Generator:
    path = tmp_path_factory.mktemp("tiny-claim-gate")
    save_tiny_model(path, VOCAB, seed=5, scale=4.0)
    loaded = load_model(ModelConfig(name=str(path), device="cpu", dtype="float32"))
    return Generator(loaded, cost=CostModel.fixed(FLAT_COST), batch_cost=FLAT)


def test_a_row_decodes_plain_until_its_claim_is_confirmed_then_drafts(generator, redis_server):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=0.3)
    store = RedisLogitNgramStore(client, RedisScope("problem", "gate"), retry_s=0.05)
    prompt = generator.encode(QUESTION, chat=False)
    store.add([NgramRow(tuple(prompt[-4:]), (1, 2), (0.5, 0.5))] * 50)  # something to draft
    store.flush()
    seen: list[bool | None] = []

    def on_commit(tokens) -> bool:
        keys = list(store._claims)
        seen.append(store.confirmed(keys[0]) if keys else None)
        if len(seen) == 6:  # six steps plain, then the server answers
            redis_server.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 10
            while store.confirmed(keys[0]) is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return True

    redis_server.send_signal(signal.SIGSTOP)
    try:
        sampling = SamplingConfig(temperature=1.0, seed=3, max_new_tokens=60)
        run = solve_problems(
            TrajectoryRunner(generator, 1),
            [ProblemInput("a", prompt, store)],
            1,
            TypeAdapter(DrafterConfig).validate_python(method_drafter("stand-dyn", {}, "cpu")),
            sampling,
            on_commit=on_commit,
        )
    finally:
        redis_server.send_signal(signal.SIGCONT)
    stats = run.problems[0].trajectories[0].output.stats
    assert seen[:6] == [None] * 6  # unanswered while the server was stopped: plain steps
    assert stats.plain_steps >= 6 and stats.tree_nodes > 0  # then it drafted
    assert store.confirmed(next(iter(store._claims))) is True
    store.close()


@pytest.mark.parametrize("method", ["stand", "stand-dyn", "auto"])
def test_two_actors_sharing_a_scope_at_once_decode_what_plain_decoding_does(
    generator, redis_server, method
):
    """Two runners (two actors' model state, each its own replica of one scope) decode the
    same problem at once, in two threads, each 3 of its greedy trajectories; every token is
    plain decoding's, and each actor merged rows the other learned."""
    prompt = generator.encode(QUESTION, chat=False)
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    plain_cfg = TypeAdapter(DrafterConfig).validate_python(method_drafter("plain", {}, "cpu"))
    cfg = TypeAdapter(DrafterConfig).validate_python(method_drafter(method, {}, "cpu"))
    from store.memory import InMemoryNgramStore

    plain = solve_problems(
        TrajectoryRunner(generator, 3),
        [ProblemInput("a", prompt, InMemoryNgramStore())],
        3,
        plain_cfg,
        greedy,
    )
    want = [t.output.token_ids for t in plain.problems[0].trajectories]
    scope = RedisScope("problem", f"two-at-once-{method}")
    stores = [RedisLogitNgramStore.connect(redis_server.url, scope=scope) for _ in range(2)]
    got: list = [None, None]

    def actor(a: int) -> None:
        gen = Generator(generator.loaded, cost=CostModel.fixed(FLAT_COST), batch_cost=FLAT)
        run = solve_problems(
            TrajectoryRunner(gen, 3), [ProblemInput("a", prompt, stores[a])], 3, cfg, greedy
        )
        got[a] = [t.output.token_ids for t in run.problems[0].trajectories]

    threads = [threading.Thread(target=actor, args=(a,)) for a in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == [want, want]
    for store in stores:
        store.flush()
        assert store.stats()["remote_updates"] > 0
        store.close()
