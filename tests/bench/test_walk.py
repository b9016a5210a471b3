"""The walk benchmark: both walks timed on the layouts of real steps, and checked equal there."""

from bench import walk


def test_the_walk_benchmark_times_both_walks_on_a_cells_steps():
    rec = walk.measure(4, 6)
    assert rec["rows"] == 4 and 0 < rec["walked"] <= 4 and rec["steps"] >= 6
    assert rec["arrays_ms"] > 0 and rec["compiled_ms"] > 0 and rec["differ"] == 0
