"""The long-context benchmarks' arithmetic and tables (their runs are in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench.long_context import flops
from bench.long_trajectories import buckets, step_flops


def test_prefill_arithmetic_is_the_weights_plus_each_chunks_attention():
    weights = 2.0 * 10 * 1000
    assert flops(1000, 10, 1, 1, chunk=1000) == pytest.approx(weights + 4.0 * 1000 * 1000)
    two = flops(1000, 10, 1, 1, chunk=500)  # the second chunk reads all 1000 keys
    assert two == pytest.approx(weights + 4.0 * 500 * 500 + 4.0 * 500 * 1000)
    assert flops(8000, 134.5e6, 30, 576) / flops(2048, 134.5e6, 30, 576) > 8000 / 2048


def test_buckets_take_the_median_full_step_of_each_context_band():
    # (context, rows, width, draft, forward, observe, wall)
    steps = [(10, 16, 1, 0.001, 0.1, 0.001, 0.11), (20, 16, 1, 0.001, 0.3, 0.001, 0.31)]
    steps += [(600, 16, 2, 0.001, 0.2, 0.001, 0.22), (700, 4, 1, 0.0, 9.0, 0.0, 9.0)]
    table = buckets(steps)
    assert [b["context"] for b in table] == [0, 512]
    assert table[0]["forward_ms"] == pytest.approx(200.0) and table[0]["host_ms"] == 10.0
    assert table[1]["steps"] == 1  # the draining 4-row step left out
    assert step_flops(16, 2, 600) == 2 * step_flops(16, 1, 600)
