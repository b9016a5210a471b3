"""STAND, dynamic, on hand-made stores: what it drafts (deterministic children, and children
drawn from the store under sampling), what calibration learns, the successor fallback and GT
sizing. Losslessness is in the shared harnesses (tests/unit/engine/:
test_decode, test_decode_sampling, test_batch) and the replay tests."""

from __future__ import annotations

import numpy as np

from store.base import NgramRow
from store.memory import InMemoryNgramStore
from tts_service.drafters.goose import AdjacencyTable
from tts_service.drafters.matching import SuffixCounts
from tts_service.drafters.stand_dyn import (
    AcceptanceCalibration,
    Candidate,
    StandDynDrafter,
    suffix_flags,
)
from tts_service.drafters.stand_dyn_config import (
    BACKOFF,
    DRAWN,
    STORE,
    SUFFIX_ORDERS,
    StandDynDrafterConfig,
    candidate_kind,
)
from tts_service.engine.cost import CostModel, VerifyCost
from tts_service.engine.seam import DraftContext, NodeTopK
from tts_service.engine.tree import SparseDist
from tts_service.engine.verify import Acceptance

VOCAB = 32


def _drafter(
    store, cfg=None, calibration=None, cost=None, successors=None, seed=0
) -> StandDynDrafter:
    d = StandDynDrafter(
        cfg or StandDynDrafterConfig(sizing="fixed"),
        store,
        SuffixCounts(SUFFIX_ORDERS),
        successors or AdjacencyTable(VOCAB, 10),
        calibration or AcceptanceCalibration(),
        cost,
        seed,
    )
    d.start([1])
    return d


def _ctx(tokens, max_nodes=80, greedy=True) -> DraftContext:
    return DraftContext(list(tokens), 1, max_nodes, greedy)


def tokens(cands: list[Candidate]) -> list[int]:
    return [token for _, token, _, _ in cands]


def rate(cal: AcceptanceCalibration, kind: int, q: float) -> float:
    """The calibrated rate of one candidate (token 0) of `kind` and stored probability `q`."""
    neg_alpha, _, _, _ = cal.rank({0: (kind, q)})[0]
    return -neg_alpha


def test_calibration_starts_below_the_stored_probability_and_learns_the_real_rate():
    cal = AcceptanceCalibration(prior_weight=4.0, prior_scale=0.8)
    kind = candidate_kind(STORE, 1, 1, 0, 0)
    assert rate(cal, kind, 0.95) == 0.8 * 0.95  # the prior: stores are overconfident
    for i in range(96):
        cal.record(kind, 0.95, accepted=i % 2 == 0)  # really accepted half the time
    assert abs(rate(cal, kind, 0.95) - (48 + 4 * 0.76) / 100) < 1e-12
    assert rate(cal, candidate_kind(STORE, 4, 4, 1, 0), 0.95) == 0.8 * 0.95  # other kinds
    assert rate(cal, kind, 0.55) == 0.8 * 0.55  # and other deciles


def test_suffix_flag_says_whether_and_how_long_the_suffix_counts_name_a_token():
    assert suffix_flags(3) == (0, 0)  # shorter than MIN_SUFFIX: not a suffix match
    assert suffix_flags(6) == (1, 2)  # (a token it does not name, one it does)
    assert suffix_flags(12) == (1, 3)


def test_the_tree_is_best_first_on_path_acceptance_and_fills_the_budget():
    store = InMemoryNgramStore()
    store.add([NgramRow((3,), (4, 5), (0.9, 0.1)), NgramRow((4,), (6, 7), (0.6, 0.4))])
    tree = _drafter(store).draft(_ctx([1, 3], max_nodes=3))
    # α̂: 4 -> 0.72, 4/6 -> 0.72 * 0.48, 4/7 -> 0.72 * 0.32 = 0.23 > 5 -> 0.08
    assert tree.tokens == (3, 4, 6, 7)
    assert tree.parents == (-1, 0, 1, 1)
    assert not any(tree.sampled)  # deterministic drafts: sample-and-match verifies them
    big = _drafter(store).draft(_ctx([1, 3], max_nodes=80))
    assert big.size - 1 > 3  # every candidate the store has, down its chains


def test_backoff_adds_the_shorter_orders_ids_and_calibration_reorders_them():
    store = InMemoryNgramStore()
    store.add([NgramRow((2, 3), (4,), (1.0,)), NgramRow((9, 3), (5,), (1.0,))])
    # the 2-gram (2, 3) says 4; the 1-gram (3,) merged both rows: 4 and 5 at 0.5 each
    d = _drafter(store)
    (_, four, four_kind, four_q), (_, five, five_kind, five_q) = d.candidates([2, 3])
    assert (four, five) == (4, 5)
    assert four_kind == candidate_kind(STORE, 2, 1, 1, 0)  # the 1-gram also ranks 4 first
    assert five_kind == candidate_kind(BACKOFF, 1, 2, 0, 0)  # 5 is the 1-gram's back-off
    for _ in range(50):  # the 2-gram's choice is never accepted, the back-off always
        d.calibration.record(four_kind, four_q, False)
        d.calibration.record(five_kind, five_q, True)
    assert tokens(d.candidates([2, 3])) == [5, 4]


def test_suffix_counts_put_a_long_shared_continuation_first():
    store = InMemoryNgramStore()
    store.add([NgramRow((7,), (8, 9), (0.6, 0.4))])
    cal, suffix = AcceptanceCalibration(), SuffixCounts(SUFFIX_ORDERS)
    earlier = StandDynDrafter(
        StandDynDrafterConfig(sizing="fixed"), store, suffix, AdjacencyTable(VOCAB, 10), cal
    )
    earlier.start([1])
    earlier.draft(_ctx([1, 2, 3, 4, 5, 6, 7, 9, 10]))  # an earlier trajectory said 7 -> 9
    now = StandDynDrafter(
        StandDynDrafterConfig(sizing="fixed"), store, suffix, AdjacencyTable(VOCAB, 10), cal
    )
    now.start([1])
    (_, eight, eight_kind, eight_q), (_, nine, nine_kind, nine_q) = now.candidates(
        [1, 2, 3, 4, 5, 6, 7]
    )
    assert [(eight, eight_kind % 4), (nine, nine_kind % 4)] == [(8, 1), (9, 2)]  # 9: a match
    for _ in range(30):
        cal.record(nine_kind, nine_q, True)
        cal.record(eight_kind, eight_q, False)
    now.draft(_ctx([1, 2, 3, 4, 5, 6, 7]))
    assert tokens(now.candidates([1, 2, 3, 4, 5, 6, 7])) == [9, 8]


def test_an_unknown_context_falls_back_to_the_successor_table():
    successors = AdjacencyTable(VOCAB, 10)
    d = _drafter(InMemoryNgramStore(), successors=successors)
    assert d.draft(_ctx([1, 3])).size == 1  # nothing known: the root alone
    tree = d.draft(_ctx([1, 3]))
    ids = np.array([[11, 12] + [0] * 8, [13, 14] + [0] * 8])
    probs = np.array([[0.7, 0.3] + [0.0] * 8, [0.5, 0.5] + [0.0] * 8])
    d.observe(tree, Acceptance((), (), 11), NodeTopK(ids[:1], probs[:1]))()  # deferred part too
    # the store now knows (3,) too; a fresh problem's store does not, the successor table does
    fresh = _drafter(InMemoryNgramStore(), successors=successors)
    tree = fresh.draft(_ctx([5, 3], max_nodes=2))
    assert tree.tokens == (3, 11, 12)


def test_gt_sizing_stops_where_more_nodes_cost_more_than_they_add():
    store = InMemoryNgramStore()
    store.add([NgramRow((3,), tuple(range(4, 14)), (0.1,) * 10)])
    steep = CostModel.fixed(VerifyCost((1, 2, 128), (0.05, 0.06, 1.32), 256))
    flat = CostModel.fixed(VerifyCost((1, 2, 128), (1.0, 1.0, 1.0), 256))
    gt = StandDynDrafterConfig(sizing="gt")
    # ten candidates at α̂ 0.08: worth 8% of a token each; a steep curve's 10 ms/token is not
    assert _drafter(store, gt, cost=steep).draft(_ctx([1, 3])).size == 1
    assert _drafter(store, gt, cost=flat).draft(_ctx([1, 3])).size == 11


def test_observe_records_only_nodes_whose_parent_was_reached():
    store = InMemoryNgramStore()
    store.add([NgramRow((3,), (4, 5), (0.9, 0.1)), NgramRow((5,), (6,), (1.0,))])
    d = _drafter(store)
    tree = d.draft(_ctx([1, 3], max_nodes=3))
    assert tree.tokens == (3, 4, 5, 6)  # 6 hangs under 5, which was not reached
    top = NodeTopK(np.zeros((4, 10), np.int64), np.zeros((4, 10)))
    d.observe(tree, Acceptance((1,), (4,), 7), top)()  # deferred part too
    drawn = d.calibration.drawn
    assert sum(drawn.values()) == 2  # 4 (accepted) and 5 (tried, rejected); not 6
    assert sum(d.calibration.hits.values()) == 1


def test_under_sampling_children_are_drawn_from_the_stored_distribution():
    """Greedy: the stored top choices. Sampling: draws without replacement from the stored q
    (the verifier's snapshot), in draw order; over many trajectory seeds the first child is
    distributed as q, while how many children there are does not depend on what was drawn."""
    store = InMemoryNgramStore()
    store.add([NgramRow((3,), (4, 5, 6), (0.6, 0.3, 0.1))])
    drawn = StandDynDrafterConfig(sizing="fixed", drawn=True)
    greedy = _drafter(store, drawn).draft(_ctx([1, 3], max_nodes=2))
    assert greedy.tokens == (3, 4, 5) and not any(greedy.sampled)
    firsts, shapes = [], set()
    for seed in range(600):
        tree = _drafter(store, drawn, seed=seed).draft(_ctx([1, 3], max_nodes=2, greedy=False))
        assert tree.sampled == (False, True, True)
        assert tree.q[0] == SparseDist((4, 5, 6), (0.6, 0.3, 0.1))
        firsts.append(tree.tokens[1])
        shapes.add(tree.parents)
    assert shapes == {(-1, 0, 0)}
    for token, q in ((4, 0.6), (5, 0.3), (6, 0.1)):
        assert abs(firsts.count(token) / 600 - q) < 4 * (q * (1 - q) / 600) ** 0.5


def test_a_node_keeps_deterministic_children_where_drawn_ones_are_rated_lower():
    store = InMemoryNgramStore()
    store.add([NgramRow((3,), (4, 5), (0.5, 0.5))])
    cal = AcceptanceCalibration()
    d = _drafter(store, StandDynDrafterConfig(sizing="fixed", drawn=True), calibration=cal)
    assert d.draft(_ctx([1, 3], max_nodes=1, greedy=False)).sampled == (False, True)  # a tie
    drawn = candidate_kind(DRAWN, 1, 1, 0, 0)  # rank 0 of a 1-gram seen once
    for _ in range(50):
        cal.record(drawn, 0.5, False)
    assert d.draft(_ctx([1, 3], max_nodes=1, greedy=False)).sampled == (False, False)
    off = _drafter(store)  # the default: deterministic children only
    assert not any(off.draft(_ctx([1, 3], greedy=False)).sampled)
