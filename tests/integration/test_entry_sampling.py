"""Sampling exactness through every production entry, for every stochastic drafter.

Each entry builds its drafters the way production does (fresh per trajectory, seeded from the
trajectory's seed) over a store whose q differs from the target's p, so drafts are often
rejected. If the drafter and the verifier shared a random stream, whether a draft is accepted
would depend on which token was drafted, and the first two committed tokens would leave p
(issue: the exactness breach). A chi-square test against the exact distribution catches it.

Each test is reproducible, so its p-value is one fixed number, not a fresh draw every run (at
1e-3 over 30 tests a draw fails one CI run in ~30): the verify costs are fixed curves (a learned
surface sizes trees by how busy the machine is) and every run nonce is pinned.
"""

from __future__ import annotations

import gc
import itertools
import threading
import zlib

import pytest
import torch
from pydantic import TypeAdapter
from scipy.stats import chisquare

import actors.host
from actors.generator import GeneratorActor
from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tests.conftest import FLAT_COST, save_tiny_model
from tests.unit.engine.test_allocate import FLAT
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import DrafterConfig, method_drafter
from tts_service.engine import collector
from tts_service.engine.cost import CostModel
from tts_service.engine.sampling import target_probs
from tts_service.generation import Generator
from tts_service.models import load_model
from tts_service.schemas import JobConfig, ServeConfig
from tts_service.serve.api import CompletionRequest
from tts_service.serve.engine import ServeEngine
from tts_service.solve import solve

pytestmark = pytest.mark.statistical  # chi-square tests over thousands of generations

VOCAB = 8
QUESTION = "w3 w5 w1 w3 w5"
SAMPLES = 1200
CHECKED_METHODS = (  # the store-fed methods, stochastic and not
    "stand",
    "stand-gt",
    "stand+spine",
    "gtcp",
    "stand-dyn",
)
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=2)  # what Serve can ask


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v8")
    save_tiny_model(path, VOCAB, seed=5, scale=4.0)
    return path


def fixed_cost_generator(cfg: ModelConfig, *args, **kwargs) -> Generator:
    """Fixed cost curves: how many nodes the allocator drafts must not hang on how loaded the
    machine is while the curves are measured (a busy box measured trees as never paying)."""
    return Generator(load_model(cfg), cost=CostModel.fixed(FLAT_COST), batch_cost=FLAT)


@pytest.fixture(scope="module")
def generator(model_dir) -> Generator:
    return fixed_cost_generator(_model_cfg(model_dir))


def nonce_of(*parts: object) -> int:
    """A run nonce of the test's own: no two tests over one model share verify keys."""
    return zlib.crc32("/".join(map(str, parts)).encode())


@pytest.fixture(scope="module")
def prompt(generator) -> list[int]:
    return generator.encode(QUESTION, chat=False)


def _model_cfg(model_dir) -> ModelConfig:
    return ModelConfig(name=str(model_dir), device="cpu", dtype="float32")


def _drafter(method: str) -> DrafterConfig:
    return TypeAdapter(DrafterConfig).validate_python(method_drafter(method, {}, "cpu"))


def exact_pairs(generator: Generator, prompt: list[int], cfg: SamplingConfig) -> dict:
    """P(t1, t2) of plain sampling, from the model's own distributions."""
    model = generator.loaded.model
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], cfg)[0]
        ctx = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = target_probs(model(ctx).logits[:, -1], cfg)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def skewed_store(prompt: list[int], exact: dict) -> InMemoryNgramStore:
    """A store whose q puts most mass where p puts least, for the contexts of t1 and of t2."""
    p1 = [sum(exact[a, b] for b in range(VOCAB)) for a in range(VOCAB)]
    ids = tuple(sorted(range(VOCAB), key=lambda t: p1[t]))  # least likely under p first
    probs = (0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02)
    store = InMemoryNgramStore()
    rows = [NgramRow(tuple(prompt[-4:]), ids, probs)]
    rows += [NgramRow((*prompt[-3:], a), ids, probs) for a in range(VOCAB)]
    store.add(rows)
    return store


def pvalue(samples: list[tuple[int, ...]], exact: dict) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    big = [k for k, p in exact.items() if p * n >= 5]  # other cells are pooled
    obs = [counts.get(k, 0) for k in big]
    exp = [exact[k] * n for k in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp > 1e-6:  # the pooled small cells
        obs, exp = [*obs, rest_obs], [*exp, rest_exp]
    elif rest_obs:  # samples where p has (almost) no mass
        return 0.0
    exp = [e * sum(obs) / sum(exp) for e in exp]  # equal totals, as chisquare requires
    return float(chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def exact(generator, prompt) -> dict:
    return exact_pairs(generator, prompt, SAMPLING)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", CHECKED_METHODS)
def test_solve_samples_exactly(generator, prompt, exact, method, batch):
    drafter, samples, accepted = _drafter(method), [], 0
    nonce = nonce_of(method, batch)
    for first in range(0, SAMPLES, batch):
        sampling = SAMPLING.model_copy(update={"seed": first, "run_nonce": nonce})
        store = skewed_store(prompt, exact)
        run = solve(generator, prompt, batch, drafter, sampling, store, max_rows=batch)
        for t in run.problems[0].trajectories:
            samples.append(t.output.token_ids)
            accepted += t.output.stats.new_tokens - t.output.stats.target_forwards
    assert accepted > 0.05 * SAMPLES, accepted  # drafts are accepted, and rejected too
    assert pvalue(samples, exact) > 1e-3


@pytest.fixture
def skewed_problem_stores(monkeypatch, prompt, exact):
    """Every problem store an entry opens starts out skewed (q far from p)."""

    def open_skewed(*args, **kwargs):
        return skewed_store(prompt, exact)

    monkeypatch.setattr(actors.host, "open_problem_store", open_skewed)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", CHECKED_METHODS)
def test_the_actor_samples_exactly(model_dir, exact, skewed_problem_stores, method, batch):
    cfg = JobConfig(
        model=_model_cfg(model_dir),
        drafter=_drafter(method),
        sampling=SAMPLING.model_copy(update={"seed": 7, "run_nonce": nonce_of(method, batch)}),
        chat=False,
        batch=batch,
        max_rows=batch,
    )
    actor = GeneratorActor(cfg, generator=fixed_cost_generator(cfg.model))
    assert gc.isenabled()  # the host settled what the actor's start held (`startup`)
    assert gc.get_threshold()[0] >= collector.YOUNG  # and widened its young budget
    samples = []
    for first in range(0, SAMPLES, batch):
        records = actor.run("job", f"p{first}", QUESTION, list(range(first, first + batch)))
        samples += [tuple(r["token_ids"]) for r in records]
    assert pvalue(samples, exact) > 1e-3


@pytest.fixture(scope="module")
def serve_engine(model_dir) -> ServeEngine:
    """`seed`: the replica's run nonces are one seeded sequence (vLLM's `--seed`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Generator, "load", fixed_cost_generator)
        return ServeEngine(ServeConfig(model=_model_cfg(model_dir), max_rows=4, seed=11))


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("method", CHECKED_METHODS)
def test_the_serve_engine_samples_exactly(serve_engine, exact, skewed_problem_stores, method, n):
    samples = []
    for first in range(0, SAMPLES, n):
        req = CompletionRequest(
            prompt=QUESTION,
            n=n,
            max_tokens=2,
            temperature=SAMPLING.temperature,
            top_p=SAMPLING.top_p,
            seed=first,
            spec_method=method,
        )
        body = serve_engine.complete(serve_engine.prepare(req), threading.Event())
        samples += [tuple(prompt_ids_of(serve_engine, c["text"])) for c in body["choices"]]
    assert pvalue(samples, exact) > 1e-3


def prompt_ids_of(engine: ServeEngine, text: str) -> list[int]:
    return engine.generator.encode(text, chat=False)
