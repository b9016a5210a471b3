"""STAND drafter: Gumbel-Top-K sampling, the noise buffer, the q snapshot, and cross-trajectory
acceleration."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tests.conftest import tiny_llama
from tests.engine_loop import generate
from tts_service.config import SamplingConfig
from tts_service.drafters.gumbel import GumbelNoise, gumbel_top_k
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.decode import plain_generate
from tts_service.engine.seam import DraftContext, NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


@pytest.mark.statistical
def test_gumbel_top_k_is_sequential_sampling_without_replacement():
    ids, q = [10, 11, 12, 13], [0.5, 0.25, 0.15, 0.1]
    noise = GumbelNoise(size=4096, seed=0)
    n = 20_000
    counts: dict[tuple[int, int], int] = {}
    for _ in range(n):
        pair = tuple(gumbel_top_k(ids, q, 2, noise.take(4)))
        counts[pair] = counts.get(pair, 0) + 1
    pairs = list(itertools.permutations(range(4), 2))
    exact = [q[a] * q[b] / (1 - q[a]) for a, b in pairs]  # first ~ q, second ~ q without first
    observed = [counts.get((ids[a], ids[b]), 0) for a, b in pairs]
    assert sum(observed) == n
    assert chisquare(observed, [e * n for e in exact]).pvalue > 1e-3


def test_gumbel_top_k_accepts_unnormalised_probabilities():
    noise = [0.3, -0.2, 1.1]
    assert gumbel_top_k([1, 2, 3], [2.0, 1.0, 0.5], 3, noise) == gumbel_top_k(
        [1, 2, 3], [0.4, 0.2, 0.1], 3, noise
    )


def test_noise_buffer_values_are_never_used_twice():
    noise = GumbelNoise(size=10, seed=1)
    taken = [v for _ in range(40) for v in noise.take(3)]  # 3 per take: the 10th value is dropped
    assert len(set(taken)) == len(taken) == 120
    assert noise.refills == 14  # ceil(40 / 3 takes per buffer)


def test_a_window_holds_the_next_buffer_only_where_a_step_could_read_past_this_one():
    """`GumbelNoise.window` (the compiled drafters' read): where the buffer holds `need` more
    values the next buffer is neither returned nor drawn; one short, it is, and the values a
    compiled step then reads are those `take` hands out."""
    noise, twin = GumbelNoise(size=10, seed=3), GumbelNoise(size=10, seed=3)
    rest, left, ahead = noise.window(4)  # an empty buffer: the next one is the first
    assert (len(rest), left, len(ahead)) == (0, 0, 4)
    noise.advance(True, 4)
    assert twin.take(4) == ahead.tolist()
    rest, left, ahead = noise.window(6)  # 6 left, 6 needed: enough
    assert (len(rest), left, len(ahead), noise.ahead) == (6, 6, 0, None)
    assert rest.tolist() == twin.take(6)
    rest, left, ahead = noise.window(7)  # one short: the next buffer, from the same stream
    assert (len(rest), left, len(ahead)) == (6, 6, 7)
    noise.advance(True, 7)
    assert ahead.tolist() == twin.take(7)  # the next buffer's first, as `take` hands them out
    assert noise.refills == twin.refills == 2


def _store_with(context, ids, probs) -> InMemoryNgramStore:
    s = InMemoryNgramStore()
    s.add([NgramRow(tuple(context), tuple(ids), tuple(probs))])
    return s


def _drafter(store, **kw) -> StandDrafter:
    return StandDrafter(StandDrafterConfig(tree="stand-625", **kw), store, seed=0)


def test_stochastic_draft_attaches_the_q_snapshot_it_sampled_from():
    store = _store_with([1, 2], [5, 6, 7], [0.6, 0.3, 0.1])
    tree = _drafter(store, num_nodes=12).draft(DraftContext([0, 1, 2], 3, 64))
    kids = tree.children[0]
    assert 1 <= len(kids) <= 3 and all(tree.sampled[c] for c in kids)
    assert len({tree.tokens[c] for c in kids}) == len(kids)  # without replacement
    assert tree.q[0].ids == (5, 6, 7) and tree.q[0].probs == (0.6, 0.3, 0.1)
    store.add([NgramRow((1, 2), (9,), (1.0,))])  # the store moves on; the snapshot does not
    assert tree.q[0].ids == (5, 6, 7)


def test_deterministic_and_greedy_drafts_take_the_top_k_in_order():
    store = _store_with([2], [5, 6, 7], [0.6, 0.3, 0.1])
    for drafter, greedy in ((_drafter(store, stochastic=False), False), (_drafter(store), True)):
        tree = drafter.draft(DraftContext([2], 1, 64, greedy=greedy))
        kids = tree.children[0]
        assert [tree.tokens[c] for c in kids] == [5, 6, 7][: len(kids)]
        assert not any(tree.sampled[c] for c in kids) and tree.q[0] is None


def test_no_match_prunes_the_subtree():
    tree = _drafter(InMemoryNgramStore()).draft(DraftContext([3, 4], 2, 64))
    assert tree.size == 1


def test_observe_stores_root_and_accepted_positions_and_optionally_rejected(tmp_path):
    shape = tmp_path / "two-children.json"
    shape.write_text('{"parents": [-1, 0, 0]}')
    for harvest, expect_entries in ((False, 2), (True, 3)):
        store = _store_with([1], [2, 3], [0.7, 0.3])
        cfg = StandDrafterConfig(tree=str(shape), stochastic=False, harvest_rejected=harvest)
        d = StandDrafter(cfg, store)
        tree = d.draft(DraftContext([0, 1], 2, 2))  # root 1 -> children 2, 3
        assert [tree.tokens[c] for c in tree.children[0]] == [2, 3]
        before = store.stats()["entries_by_order"]["2"]
        ids = np.array([[2, 3], [4, 5], [6, 7]])
        d.observe(tree, Acceptance((1,), (2,), 4), NodeTopK(ids, np.full((3, 2), 0.5)))()
        # root context (0, 1) and accepted (1, 2); harvesting adds the rejected (1, 3)
        assert store.stats()["entries_by_order"]["2"] - before == expect_entries
        assert store.lookup([1, 2]).ids == (4, 5)


def test_a_store_filled_by_an_earlier_trajectory_accelerates_the_next():
    model = tiny_llama(vocab_size=256, seed=5, scale=6.0)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = SamplingConfig(temperature=0, max_new_tokens=64)
    drafter = _drafter(InMemoryNgramStore(), num_nodes=80)
    first = generate(model, prompt, drafter, cfg, eos_ids=[])
    second = generate(model, prompt, drafter, cfg, eos_ids=[])
    ref = plain_generate(model, prompt, cfg, eos_ids=[])
    assert first.token_ids == second.token_ids == ref.token_ids
    assert second.stats.acceptance_length > 3, second.stats.acceptance_length
    assert second.stats.acceptance_length > first.stats.acceptance_length


def test_draft_tree_is_well_formed_for_a_full_shape():
    store = InMemoryNgramStore()
    g = torch.Generator().manual_seed(0)
    for t in range(50):
        ids = torch.randperm(50, generator=g)[:10].tolist()
        store.add([NgramRow((t % 7,), tuple(ids), tuple([0.1] * 10))])
    tree = _drafter(store, num_nodes=625).draft(DraftContext([1, 2, 3], 3, 1024))
    assert isinstance(tree, DraftTree) and 1 < tree.size <= 626
    for node in range(tree.size):  # siblings distinct
        toks = [tree.tokens[c] for c in tree.children[node]]
        assert len(toks) == len(set(toks))
