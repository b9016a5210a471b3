"""The verify cost curve: the monotone fit, GTCP's count and growth rule on hand-made curves,
the measured curve (monotone, calibrated in seconds), and re-measuring as contexts grow.

GT's drafters on these curves are tested in tests/unit/drafters/test_gt.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.conftest import tiny_llama
from tts_service.engine.cost import (
    CostModel,
    VerifyCost,
    context_bucket,
    gt_count,
    measure_verify_cost,
    worth_growing,
)

# CPU-like: one token is a matrix-vector product, two are a matrix product, then ~linear
CPU = VerifyCost((1, 2, 8, 16, 64, 128), (0.053, 0.088, 0.094, 0.113, 0.2, 0.3), 256)
GPU = VerifyCost((1, 2, 64, 128), (0.020, 0.0201, 0.0205, 0.030), 256)  # flat up to 64


def test_fit_makes_the_cost_curve_monotone_and_interpolates():
    c = VerifyCost.fit((1, 2, 4), (0.05, 0.04, 0.06), 100)
    assert c.seconds == (0.05, 0.05, 0.06)
    assert c.time(3) == pytest.approx(0.055) and c.time(8) == pytest.approx(0.08)  # extrapolated
    assert c.time(3) - c.time(2) == pytest.approx(0.005)
    with pytest.raises(ValueError, match="non-decreasing"):
        VerifyCost((1, 2), (0.2, 0.1), 10)


def test_gt_count_keeps_the_nodes_worth_their_cost_by_hand():
    # one draft node at 0.2: (1.2)/T(2)=13.6/s < 1/T(1)=18.9/s, so none is kept on the CPU...
    assert gt_count([0.2], CPU, 10) == 0
    # ...but seven good nodes together pay for the jump: (1 + 7 * 0.2) / T(8) = 25.5/s
    assert gt_count([0.2] * 7, CPU, 10) == 7
    # hand-made decaying α̂: the best rate is at k = 5 (checked by brute force)
    alphas = [0.6, 0.4, 0.3, 0.2, 0.12, 0.003, 0.002, 0.001]
    rates = [(1 + sum(alphas[:k])) / CPU.time(k + 1) for k in range(len(alphas) + 1)]
    assert gt_count(alphas, CPU, 8) == max(range(len(rates)), key=rates.__getitem__) == 5
    # where tree tokens are nearly free, everything with α̂ > c ≈ 0 is kept, up to the cap
    assert gt_count(alphas, GPU, 8) == 8 and gt_count(alphas, GPU, 3) == 3


def test_worth_growing_looks_past_the_first_token_jump():
    assert not worth_growing(CPU, 1, 1.0, 0.3, 2)  # only one more token allowed: not worth it
    assert worth_growing(CPU, 1, 1.0, 0.3, 16)  # a bigger tree at this quality is
    assert not worth_growing(CPU, 8, 2.0, 0.001, 128)
    assert worth_growing(GPU, 40, 2.0, 0.01, 64)


def test_measured_cost_curve_is_monotone_and_calibrates_in_seconds():
    """A model wide enough that 256 tokens cost clearly more than one on any CPU (here 1.4 ms
    against 12.3): at the tiny test width a forward is all overhead, and in one CI run a slow
    1-token reading made the fitted curve flat (2.9 ms from 1 to 256 tokens)."""
    model = tiny_llama(
        vocab_size=64, seed=0, dtype=torch.float32, hidden_size=256, intermediate_size=1024
    )
    t0 = time.perf_counter()
    cost = measure_verify_cost(model, 200, sizes=(1, 4, 16, 64, 256), repeats=3)
    assert time.perf_counter() - t0 < 30  # seconds, not minutes (SmolLM2 here: ~6 s)
    assert cost.context_len == 200
    assert all(b >= a for a, b in zip(cost.seconds, cost.seconds[1:], strict=False))
    assert cost.time(256) > cost.time(1)  # a 256-token forward is measurably dearer


def test_cost_model_measures_again_when_contexts_grow_into_a_new_bucket():
    asked = []

    def fake_measure(n: int) -> VerifyCost:
        asked.append(n)
        return CPU

    costs = CostModel(fake_measure, max_context=10_000)
    for n in (10, 200, 256, 300, 900, 2000, 9000):
        costs.at(n)
    assert asked == [256, 1024, 4096, 10_000 - 128]
    assert context_bucket(257) == 1024 and context_bucket(1) == 256
