"""`bench/ceiling.py`: the best-first search finds the k most probable continuations (against
enumerating every sequence), and its tree forwards give the distributions a plain forward of
each continuation gives."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench.ceiling import BestTree, TrajectoryTarget, best_tree
from tests.conftest import tiny_llama
from tts_service.engine.sampling import SamplingParams, target_probs

V = 5


def toy_p(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed, uneven next-token distribution per context (some tokens impossible)."""
    g = torch.Generator().manual_seed(hash(path) % (2**31))
    w = torch.rand(V, generator=g, dtype=torch.float64) ** 3
    w[len(path) % V] = 0.0
    return w / w.sum()


def enumerate_best(k: int) -> list[float]:
    """Every sequence up to length k, by probability: the k largest."""
    probs = []
    for depth in range(1, k + 1):
        for seq in itertools.product(range(V), repeat=depth):
            prob = 1.0
            for i, x in enumerate(seq):
                prob *= float(toy_p(seq[:i])[x])
            probs.append(prob)
    return sorted(probs, reverse=True)[:k]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_best_first_finds_the_k_most_probable_continuations(k):
    asked: list[tuple[int, ...]] = []

    def expand(paths):
        asked.extend(paths)
        return [toy_p(p) for p in paths]

    tree = best_tree(toy_p(()), expand, k)
    assert tree.probs == pytest.approx(enumerate_best(k), abs=1e-15)
    assert tree.expected(k) == pytest.approx(1 + sum(enumerate_best(k)))
    # a tree: every path's prefix is in it, before it
    for i, path in enumerate(tree.paths):
        assert path[:-1] == () or path[:-1] in tree.paths[:i]
    assert len(set(asked)) == len(asked) == tree.forwarded  # nothing forwarded twice


def test_matched_is_the_deepest_drafted_prefix_of_the_sample():
    tree = BestTree([(1,), (2,), (1, 3), (1, 3, 0)], [0.5, 0.3, 0.2, 0.1], 0)
    assert tree.matched(4, [1, 3, 0, 2]) == 3
    assert tree.matched(3, [1, 3, 0, 2]) == 2  # the depth-3 node is not drafted at k = 3
    assert tree.matched(4, [4, 1]) == 0
    assert tree.matched(4, [2]) == 1


def test_tree_forwards_equal_plain_forwards_of_each_continuation():
    model = tiny_llama(vocab_size=32, seed=3, scale=4.0)
    cfg = SamplingParams(temperature=0.8)
    prompt = [3, 7, 1, 9]
    target = TrajectoryTarget(model, cfg, prompt)
    target.advance(4)
    target.advance(11)
    context = [*prompt, 4, 11]
    paths = [(2,), (2, 5), (6,), (2, 5, 8)]
    got = target.expand(paths)
    assert target.cache.get_seq_length() == len(context) - 1  # the tree's writes are dropped
    for path, p in zip(paths, got, strict=True):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[*context, *path]])).logits[0, -1:]
        assert torch.allclose(p, target_probs(logits, cfg)[0], atol=1e-9)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([context])).logits[0, -1:]
    assert torch.allclose(target.root, target_probs(logits, cfg)[0], atol=1e-9)
