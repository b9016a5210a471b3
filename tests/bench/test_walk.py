"""The walk benchmark: the compiled walk timed on the layouts of real steps."""

from bench import walk


def test_the_walk_benchmark_times_the_compiled_walk_on_a_cells_steps():
    rec = walk.measure(4, 6)
    assert rec["rows"] == 4 and 0 < rec["walked"] <= 4 and rec["steps"] >= 6
    assert rec["compiled_ms"] > 0
