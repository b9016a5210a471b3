"""`bench/drawn_children.py`'s exact acceptances against the verifier itself: one drawn child
is accepted with probability sum(min(p, q)); two, as often as recursive rejection sampling
accepts one of two children drawn without replacement from q."""

from __future__ import annotations

import torch

from bench.drawn_children import drawn_accept, top_k_accept
from tts_service.drafters.gumbel import gumbel_top_k
from tts_service.engine.tree import SparseDist, TreeBuilder
from tts_service.engine.verify import verify_node

P = {0: 0.35, 1: 0.25, 2: 0.2, 3: 0.1, 4: 0.06, 5: 0.04}
Q = {1: 0.5, 2: 0.3, 0: 0.1, 3: 0.1}


def test_one_drawn_child_and_the_top_choices():
    assert abs(drawn_accept(P, Q, 1) - sum(min(P[t], q) for t, q in Q.items())) < 1e-12
    assert top_k_accept(P, Q, 1) == P[1] and abs(top_k_accept(P, Q, 2) - 0.45) < 1e-12
    assert drawn_accept(P, {2: 1.0}, 1) == P[2]  # a one-hot q is a deterministic child


def test_two_drawn_children_match_the_verifier():
    p = torch.tensor([P[t] for t in range(6)], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    noise = torch.Generator().manual_seed(1)
    ids, probs = list(Q), list(Q.values())
    n, hits = 20000, 0
    for _ in range(n):
        u = torch.rand(len(ids), generator=noise, dtype=torch.float64).clamp_(min=1e-300)
        order = gumbel_top_k(ids, probs, 2, (-torch.log(-torch.log(u))).tolist())
        b = TreeBuilder(5)
        for token in order:
            b.add(0, token, sampled=True)
        b.set_q(0, SparseDist(tuple(ids), tuple(probs)))
        child, _ = verify_node(b.build(), 0, p, gen)
        hits += child is not None
    want = drawn_accept(P, Q, 2)
    assert abs(hits / n - want) < 4 * (want * (1 - want) / n) ** 0.5, (hits / n, want)
