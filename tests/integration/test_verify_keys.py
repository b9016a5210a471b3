"""A draft never depends on the uniforms that verify it, even where seeds repeat.

Trajectory i of every problem of a job has the job's seed + i, a re-run may pass the same seed,
and so may Serve requests; drafter state outlives a row (`stand-dyn`'s calibration per model,
which learns whether each drafted candidate was accepted; the problem's store; the global
tier). If row B verified with row A's uniforms and drafted from what A's verification taught,
B's draft would depend on B's own verifier draws, and its tokens would leave p.

Each test runs row A, then row B with the same prompt and seed over identically filled stores
(two stored candidates at q near 0.5, seen often), on a model whose drafter state is fresh for
each pair (a new process), A verified and observed before B drafts (`max_rows=1`), at T = 1.0,
and tests B's first token against p (chi-square). What A's verification taught the calibration
decides whether B draws its children from q; with A's uniforms (and A's draft noise) that
decision says which way B's own draws fall. The negative control forces the old behaviour
(rows keyed by their seed alone, no ledger) and must fail (p ~ 1e-12), so the harness cannot
pass vacuously.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import TypeAdapter
from scipy.stats import chisquare

from store.base import NgramRow
from store.memory import InMemoryNgramStore, TieredStore
from store.redis_store import RedisLogitNgramStore, RedisScope
from tests.conftest import FLAT_COST, save_tiny_model
from tests.unit.engine.test_allocate import FLAT
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import (
    DrafterConfig,
    RowDrafters,
    VerifyKeyReusedError,
    method_drafter,
)
from tts_service.engine.cost import CostModel
from tts_service.engine.sampling import SamplingParams, target_probs
from tts_service.engine.streams import row_salt, verify_key
from tts_service.generation import Generator
from tts_service.models import load_model
from tts_service.runner import TrajectoryRunner
from tts_service.solve import ProblemInput, solve_problems
from tts_service.trajectory import TrajectoryRequest

pytestmark = pytest.mark.statistical

VOCAB = 8
QUESTION = "w3 w5 w1 w3 w5"
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=3)  # the first token is tested
RUNS = 600
SEEN = 400
METHODS = ("stand-dyn", "auto")  # stand-dyn with drawn children; auto draws them on a CPU


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v8-keys")
    save_tiny_model(path, VOCAB, seed=5, scale=4.0)
    return load_model(ModelConfig(name=str(path), device="cpu", dtype="float32"))


def fresh_generator(loaded) -> Generator:
    """The loaded model with fresh drafter state (calibration, successor tables, ledger), as a
    new process has it; fixed costs, so the allocator's decisions do not hang on the load."""
    return Generator(loaded, cost=CostModel.fixed(FLAT_COST), batch_cost=FLAT)


@pytest.fixture(scope="module")
def prompt_and_p(loaded) -> tuple[list[int], list[float]]:
    prompt = fresh_generator(loaded).encode(QUESTION, chat=False)
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0, -1:]
    return prompt, target_probs(logits, SamplingParams.of(SAMPLING))[0].tolist()


def drafter(method: str) -> DrafterConfig:
    presets = {"stand_dyn": {"drawn": True}} if method == "stand-dyn" else {}
    return TypeAdapter(DrafterConfig).validate_python(method_drafter(method, presets, "cpu"))


def half_and_half(prompt: list[int], p: list[float]) -> list[NgramRow]:
    """The prompt's context with p's two likeliest tokens at q = 0.51 and 0.49."""
    top = sorted(range(VOCAB), key=lambda t: -p[t])[:2]
    return [NgramRow(tuple(prompt[-4:]), tuple(top), (0.51, 0.49))]


def filled(rows: list[NgramRow], store=None):
    """`rows` stored `SEEN` times: a row's own write (p merged in) leaves its entry's
    calibration key (count bucket, q decile) as it was, so what a row taught applies to the
    next row that reads the same store or tier."""
    store = store if store is not None else InMemoryNgramStore()
    store.add(rows * SEEN)
    return store


def pvalue(tokens: list[int], p: list[float]) -> float:
    counts = [tokens.count(t) for t in range(VOCAB)]
    big = [t for t in range(VOCAB) if p[t] * len(tokens) >= 5]
    obs = [counts[t] for t in big] + [len(tokens) - sum(counts[t] for t in big)]
    exp = [p[t] * len(tokens) for t in big] + [len(tokens) * (1 - sum(p[t] for t in big))]
    if exp[-1] < 1e-6:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(chisquare(obs, exp).pvalue)


def sampling(seed: int, nonce: int | None) -> SamplingConfig:
    return SAMPLING.model_copy(update={"seed": seed, "run_nonce": nonce})


def first_token(run) -> int:
    return run.problems[-1].trajectories[0].output.token_ids[0]


def pairs_in_one_run(loaded, method, stores) -> list[int]:
    """B's first token over `RUNS` jobs of two problems (A, B): same prompt, same seed."""
    prompt = fresh_generator(loaded).encode(QUESTION, chat=False)
    out = []
    for seed in range(RUNS):
        a, b = stores()
        problems = [ProblemInput("a", prompt, a), ProblemInput("b", prompt, b)]
        runner = TrajectoryRunner(fresh_generator(loaded), 1)
        run = solve_problems(runner, problems, 1, drafter(method), sampling(seed, RUNS + seed))
        out.append(first_token(run))
    return out


@pytest.fixture
def old_keys(monkeypatch):
    """The old behaviour: a row's streams are its seed's alone, and nothing refuses a key that
    drafter state has already learned from."""
    monkeypatch.setattr(TrajectoryRequest, "params", lambda self: SamplingParams.of(self.sampling))
    monkeypatch.setattr(RowDrafters, "_claim", lambda self, key, store, params: None)


@pytest.mark.parametrize("method", METHODS)
def test_problems_sharing_a_seed_sample_exactly(loaded, prompt_and_p, method):
    prompt, p = prompt_and_p
    rows = half_and_half(prompt, p)
    tokens = pairs_in_one_run(loaded, method, lambda: (filled(rows), filled(rows)))
    assert pvalue(tokens, p) > 1e-3


def test_the_negative_control_detects_colliding_keys(loaded, prompt_and_p, old_keys):
    prompt, p = prompt_and_p
    rows = half_and_half(prompt, p)
    tokens = pairs_in_one_run(loaded, "stand-dyn", lambda: (filled(rows), filled(rows)))
    assert pvalue(tokens, p) < 1e-6


@pytest.mark.parametrize("method", METHODS)
def test_problems_sharing_a_global_tier_sample_exactly(loaded, prompt_and_p, method):
    """The candidates come from the global tier alone; each problem's own scope starts empty."""
    prompt, p = prompt_and_p
    rows = half_and_half(prompt, p)

    def stores():
        shared = filled(rows)
        return TieredStore(InMemoryNgramStore(), shared), TieredStore(InMemoryNgramStore(), shared)

    assert pvalue(pairs_in_one_run(loaded, method, stores), p) > 1e-3


def test_a_rerun_over_a_persistent_store_samples_exactly(loaded, prompt_and_p, redis_server):
    """Run 1 solves the problem into a Redis scope; run 2, in the same process (an actor, a
    replica), re-opens the scope and solves it again with the same seed. Each run draws its
    own nonce, as by default."""
    prompt, p = prompt_and_p
    rows, tokens = half_and_half(prompt, p), []
    for seed in range(RUNS):
        gen, scope = fresh_generator(loaded), RedisScope("problem", f"rerun-{seed}")
        filled(rows, RedisLogitNgramStore.connect(redis_server.url, scope=scope)).close()
        for _ in range(2):
            store = RedisLogitNgramStore.connect(redis_server.url, scope=scope)
            problems = [ProblemInput("a", prompt, store)]
            run = solve_problems(
                TrajectoryRunner(gen, 1), problems, 1, drafter("stand-dyn"), sampling(seed, None)
            )
        tokens.append(first_token(run))
    assert pvalue(tokens, p) > 1e-3


@pytest.mark.parametrize("method", ("stand", *METHODS))
def test_two_actors_sharing_a_redis_scope_sample_exactly(
    loaded, prompt_and_p, redis_server, method
):
    """Two actors (each its own model state and its own replica of one Redis scope): A solves
    with a seed, then B, whose replica replayed what A taught the scope, solves with the same
    seed (its own nonce). B's first token against p; B's claim is confirmed before its first
    draft, so that the first token is a drafted one."""
    prompt, p = prompt_and_p
    rows, tokens, drafted = half_and_half(prompt, p), [], 0
    for seed in range(RUNS):
        scope = RedisScope("problem", f"two-actors-{method}-{seed}")
        store_a = filled(rows, RedisLogitNgramStore.connect(redis_server.url, scope=scope))
        run_a = [ProblemInput("a", prompt, store_a)]
        solve_problems(
            TrajectoryRunner(fresh_generator(loaded), 1),
            run_a,
            1,
            drafter(method),
            sampling(seed, 1),
        )
        store_a.close()
        store_b = RedisLogitNgramStore.connect(redis_server.url, scope=scope)
        store_b.preclaim([verify_key(seed, row_salt(2, "a", 0))])
        store_b.flush()
        run_b = solve_problems(
            TrajectoryRunner(fresh_generator(loaded), 1),
            [ProblemInput("a", prompt, store_b)],
            1,
            drafter(method),
            sampling(seed, 2),
        )
        assert store_b.stats()["remote_updates"] > 0
        store_b.close()
        tokens.append(first_token(run_b))
        drafted += run_b.problems[0].trajectories[0].output.stats.tree_nodes > 0
    assert drafted > RUNS // 2  # the harness tests drafted tokens, not plain ones
    assert pvalue(tokens, p) > 1e-3


def test_a_run_nonce_reused_over_its_own_writes_never_drafts(loaded, prompt_and_p, redis_server):
    """Reproducing a run by its nonce over the store it wrote (another process: the model's
    own ledger is fresh): the scope's claims refuse the keys, in the background, so those rows
    decode plain to their end (exact by construction), counted in the store's stats; over a
    fresh scope the same nonce drafts again. (Token for token a sampled run reproduces over an
    in-process store only: a shared one's replication runs beside the steps.)"""
    prompt, p = prompt_and_p
    rows = half_and_half(prompt, p)

    def run(scope_id: str):
        scope = RedisScope("problem", scope_id)
        store = RedisLogitNgramStore.connect(redis_server.url, scope=scope)
        if store.stats()["remote_updates"] == 0:
            filled(rows, store)
        runner = TrajectoryRunner(fresh_generator(loaded), 1)
        problems = [ProblemInput("a", prompt, store)]
        return solve_problems(runner, problems, 4, drafter("auto"), sampling(7, 12345)), store

    first, _ = run("reused")
    reused, store = run("reused")
    store.flush()
    assert store.stats()["refused_claims"] == 4
    for t in reused.problems[0].trajectories:  # no row drafted a node
        assert t.output.stats.tree_nodes == 0
    again, store = run("fresh")
    store.flush()
    assert again.run_nonce == first.run_nonce == 12345
    assert store.stats()["refused_claims"] == 0 and store.stats()["unchecked_claims"] == 0


def test_one_model_refuses_a_key_it_has_learned_from(loaded, prompt_and_p):
    """Two runs with one nonce in one process, each over a fresh store: the model's ledger
    refuses the second (its calibration learned from the first's uniforms)."""
    prompt, p = prompt_and_p
    runner = TrajectoryRunner(fresh_generator(loaded), 1)
    for attempt in range(2):
        problems = [ProblemInput("a", prompt, filled(half_and_half(prompt, p)))]
        if attempt == 0:
            solve_problems(runner, problems, 2, drafter("auto"), sampling(3, 99))
        else:
            with pytest.raises(VerifyKeyReusedError, match="this model's drafters"):
                solve_problems(runner, problems, 2, drafter("auto"), sampling(3, 99))
    plain = drafter("plain")
    for _ in range(2):  # plain rows draft nothing: a seed repeats them exactly, every time
        problems = [ProblemInput("a", prompt, InMemoryNgramStore())]
        solve_problems(runner, problems, 2, plain, sampling(3, 99))
