"""Observation off the critical path: the drafters' deferred learning runs during the next
forward, deterministically, and leaves the stores as inline observation does (what the verified
paths taught them; rejected nodes, with `harvest_rejected`, depend on the trees drafted)."""

from __future__ import annotations

import pytest
import torch

from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS, FLAT_COST, tiny_llama
from tests.engine_loop import decode_rows
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DraftEnv, build_drafter
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import CostModel
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions

VOCAB = 64
PROMPTS = ([1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7], [9, 9, 9, 4])


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=3, scale=4.0)


def run(model, method: str, temperature: float, defer: bool, shared: bool = False, **fields):
    """Three rows, each with its own store (or one they share), the method's drafter with
    `fields` changed; their outputs and stores."""
    drafter = DRAFTER_CONFIGS[method].model_copy(update=fields)
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(defer_observation=defer))
    one = InMemoryNgramStore()
    stores = [one if shared else InMemoryNgramStore() for _ in PROMPTS]
    rows = []
    for i, (prompt, store) in enumerate(zip(PROMPTS, stores, strict=True)):
        env = DraftEnv(VOCAB, store, i, CostModel.fixed(FLAT_COST))
        cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=i, ignore_eos=True)
        rows.append(decoder.new_row(prompt, build_drafter(drafter, env), cfg))
    results = decode_rows(decoder, rows, token_budget=3 * 9)
    assert not decoder.deferred  # nothing left unobserved once the batch is empty
    return [r.token_ids for r in results], stores, sum(r.stats.target_forwards for r in results)


def contents(store: InMemoryNgramStore) -> dict:
    return {k: (e.ids, e.probs, e.count) for k, e in store.items()}


@pytest.mark.parametrize("method", ["stand", "stand-dyn"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_seed_gives_the_same_output_on_every_run(model, method, temperature):
    first = run(model, method, temperature, defer=True, shared=True)
    again = run(model, method, temperature, defer=True, shared=True)
    assert first[0] == again[0] and first[2] == again[2]
    assert contents(first[1][0]) == contents(again[1][0])


@pytest.mark.parametrize("method", ["stand", "stand-dyn"])
@pytest.mark.parametrize("harvest", [False, True])
def test_deferred_greedy_equals_plain_and_stores_equal_inline(model, method, harvest):
    """With `harvest_rejected` the store also holds the rejected nodes' distributions, and which
    nodes a step rejects depends on the trees drafted (from a store one step behind when
    deferred): the outputs stay plain decoding's, the stores may differ. Without it they hold
    the verified paths only, the same either way."""
    deferred, d_stores, d_forwards = run(model, method, 0.0, True, harvest_rejected=harvest)
    inline, i_stores, i_forwards = run(model, method, 0.0, False, harvest_rejected=harvest)
    for prompt, out in zip(PROMPTS, deferred, strict=True):
        cfg = SamplingConfig(temperature=0.0, max_new_tokens=40, ignore_eos=True)
        assert out == plain_generate(model, prompt, cfg, []).token_ids
    assert deferred == inline
    assert d_forwards < 3 * 40  # it did speculate (and so drafted from a lagging store)
    if harvest:
        return
    for d, i in zip(d_stores, i_stores, strict=True):
        a, b = contents(d), contents(i)
        assert a.keys() == b.keys()
        for key, (ids, probs, count) in a.items():
            assert ids == b[key][0] and count == b[key][2], key
            assert torch.allclose(torch.tensor(probs), torch.tensor(b[key][1]), atol=1e-9)


def test_observation_of_a_step_waits_for_the_next_forward(model):
    """The stores lag one step while rows run: after a step, that step's distributions are not
    yet stored; after the next step's forward they are."""
    decoder = BatchDecoder(model, eos_ids=[])
    store = InMemoryNgramStore()
    env = DraftEnv(VOCAB, store, 0, CostModel.fixed(FLAT_COST))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    row = decoder.new_row(PROMPTS[0], build_drafter(DRAFTER_CONFIGS["stand"], env), cfg)
    decoder.join([row])
    decoder.step(8)
    assert decoder.deferred and not store.items()
    decoder.step(8)
    assert store.items() and decoder.deferred


def test_rule_c_gathered_for_every_node_equals_the_walk_from_dense_p(model):
    """STAND's sampled trees (rule (c)): the GPU path (every node's support gathered on the
    device, one copy; every row walked at once, compiled) and the CPU path (the visited nodes
    from the dense p, `verify.walk_sparse`) commit the same tokens for the same seeds: the same
    data, the same uniforms."""
    outputs = []
    for gathered in (True, False):
        decoder = BatchDecoder(model, eos_ids=[])
        decoder.acceptance.gather_sparse = gathered
        rows = []
        for i, prompt in enumerate(PROMPTS):
            env = DraftEnv(VOCAB, InMemoryNgramStore(), i, CostModel.fixed(FLAT_COST))
            cfg = SamplingConfig(temperature=0.8, max_new_tokens=40, seed=i, ignore_eos=True)
            drafter = build_drafter(DRAFTER_CONFIGS["stand"], env)
            rows.append(decoder.new_row(prompt, drafter, cfg))
        results = decode_rows(decoder, rows, token_budget=3 * 9)
        outputs.append([r.token_ids for r in results])
        assert sum(r.stats.tree_nodes for r in results) > 20  # sampled trees were verified
    assert outputs[0] == outputs[1]
