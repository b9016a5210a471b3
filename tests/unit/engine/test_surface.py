"""The learned step cost surface: the roofline fit, learning per bucket, the disk copy, and the
planner on synthetic step timings (flat, steep, and a step change halfway), including how
much it explores."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import tiny_llama
from tests.unit.engine.test_allocate import _stats
from tts_service.engine.allocate import KEPT_DECISIONS, REFRESH_STEPS, SpeculationPlanner
from tts_service.engine.surface import (
    CostSurface,
    ModelShape,
    Roofline,
    SurfaceVerifyCost,
    open_surface,
    power_bucket,
)

# about SmolLM2-135M in fp32: 540 MB of weights, 270 MFLOP per token
SHAPE = ModelShape(5.4e8, 9.2e4, 2.7e8, 1.1e4)
CONTEXT = 200


def test_power_buckets():
    assert [power_bucket(x) for x in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


@pytest.mark.parametrize("overlap", [1.0, 0.0], ids=["cpu-additive", "gpu-overlapped"])
def test_the_roofline_fit_recovers_the_device_from_two_timings(overlap):
    truth = Roofline(SHAPE, bandwidth=1.2e10, flops=2e11, overlap=overlap)
    wide = 32 if overlap else 4096  # a GPU is compute-bound only at many tokens
    fit = Roofline.fit(SHAPE, overlap, 128, truth.time(1, 1, 128), truth.time(1, wide, 128), wide)
    assert fit.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert fit.flops == pytest.approx(truth.flops, rel=1e-6)
    for rows, width in [(1, 1), (16, 1), (16, 8), (64, 4)]:
        assert fit.time(rows, width, 500) == pytest.approx(truth.time(rows, width, 500))


def _surface() -> CostSurface:
    return CostSurface(Roofline(SHAPE, 1.2e10, 2e11, 1.0))


def test_a_bucket_learns_its_own_time_and_others_follow_the_overall_correction():
    s = _surface()
    prior = s.time(16, 2, CONTEXT)
    for _ in range(40):  # the device is 3x slower than the roofline at 16 rows x 2 tokens
        s.record(16, 2, CONTEXT, 3.0 * s.roofline.time(16, 2, CONTEXT))
    assert s.time(16, 2, CONTEXT) == pytest.approx(3.0 * prior, rel=0.02)
    assert s.correction(16, 2, CONTEXT)[1] < 0.1
    # an untimed bucket moves toward the overall correction but stays uncertain
    assert s.time(1, 8, CONTEXT) == pytest.approx(3.0 * s.roofline.time(1, 8, CONTEXT), rel=0.02)
    assert s.correction(1, 8, CONTEXT)[1] == pytest.approx(0.4)
    # pessimistic and optimistic bounds bracket the estimate
    assert s.time(1, 8, CONTEXT, z=-1) < s.time(1, 8, CONTEXT) < s.time(1, 8, CONTEXT, z=1)


@pytest.mark.parametrize("overlap", [1.0, 0.0], ids=["cpu-additive", "gpu-overlapped"])
def test_a_line_reads_what_time_and_correction_read_at_every_width(overlap):
    """The planner prices every k from one `line` (one correction per width bucket): it must
    be the surface's own `time` and `correction`, bit for bit, at every width and bound."""
    s = CostSurface(Roofline(SHAPE, 1.2e10, 2e11, overlap))
    for width in (1, 2, 4, 8, 16):
        s.record(16, width, CONTEXT, 1.7 * width**0.3 * s.roofline.time(16, width, CONTEXT))
    for rows, context in [(1, 50), (16, CONTEXT), (64, 5000)]:
        line = s.line(rows, 65, context)
        assert len(line) == 65
        for width, (t, mean, sd) in enumerate(line, start=1):
            assert sd == s.correction(rows, width, context)[1]
            for z in (-1.0, 0.0, 1.0):
                assert t * math.exp(mean + z * sd) == s.time(rows, width, context, z)


def test_old_evidence_fades():
    s = _surface()
    for _ in range(20):
        s.record(4, 1, CONTEXT, 2.0 * s.roofline.time(4, 1, CONTEXT))
    fresh = s.correction(4, 1, CONTEXT)[1]
    for _ in range(300):  # other shapes run meanwhile
        s.record(16, 1, CONTEXT, s.roofline.time(16, 1, CONTEXT))
    assert s.correction(4, 1, CONTEXT)[1] > 2 * fresh


def test_the_surface_survives_a_restart_on_disk(tmp_path):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    first = open_surface(model, "tiny", tmp_path)
    assert first.source == "prior"
    for _ in range(30):
        first.record(8, 4, CONTEXT, 0.05)
    first.save()
    (path,) = tmp_path.iterdir()
    second = open_surface(model, "tiny", tmp_path)
    assert second.source == "disk"
    assert second.time(8, 4, CONTEXT) == pytest.approx(0.05, rel=0.02)
    # trusted like a few steps only, so a new process adapts quickly
    assert first.correction(8, 4, CONTEXT)[1] < second.correction(8, 4, CONTEXT)[1] < 0.4
    path.write_text("{not json")
    again = open_surface(model, "tiny", tmp_path)
    assert again.source == "prior"  # unreadable: start over, and overwrite it
    again.save()
    assert "roofline" in json.loads(path.read_text())


def test_gt_sizing_reads_a_monotone_one_row_curve_off_the_surface():
    s = _surface()
    curve = SurfaceVerifyCost(lambda: s).at(CONTEXT)
    assert list(curve.seconds) == sorted(curve.seconds)
    assert curve.time(1) == pytest.approx(s.time(1, 1, 256, z=1.0))


# -- the planner on synthetic timings ---------------------------------------------------


def flat(rows: int, width: int) -> float:
    """A GPU-like device: tree tokens nearly free."""
    return 0.010 * (1 + 0.001 * rows * width)


def steep(rows: int, width: int) -> float:
    """A CPU at many rows: every token costs."""
    return 0.004 + 0.003 * rows * width


def _drive(truth, steps: int, rows: int, planner: SpeculationPlanner, decisions: list[int]):
    stats = [_stats(0.8)] * rows
    for _ in range(steps):
        k = planner.plan(CONTEXT, stats)
        planner.surface.record(rows, k + 1, CONTEXT, truth(rows, k + 1))
        decisions.append(k)


def _planner() -> SpeculationPlanner:
    # the prior is wrong both ways: a CPU-like roofline, 10x off in scale
    return SpeculationPlanner(surface=CostSurface(Roofline(SHAPE, 1.2e9, 2e10, 1.0)))


@pytest.mark.parametrize("rows", [1, 16])
def test_the_planner_drafts_on_a_flat_device_and_not_on_a_steep_one(rows):
    decisions: list[int] = []
    planner = _planner()
    _drive(flat, 200, rows, planner, decisions)
    assert sum(k < 3 for k in decisions[20:]) <= planner.explored, decisions[:40]
    decisions = []
    planner = _planner()
    _drive(steep, 200, rows, planner, decisions)
    if rows == 16:  # 16 rows x 2 tokens cost 1.9x 16 x 1: no tree pays
        assert sum(k > 0 for k in decisions[20:]) <= planner.explored
    assert planner.explored <= 0.01 * planner.steps


def test_the_planner_explores_below_its_cap_when_the_cap_is_its_decision():
    """At k = max_nodes the next wider bucket is beyond the cap and the narrower one ends at
    the cap (it once reached past the cost line: an IndexError on a GPU's flat surface)."""
    planner = SpeculationPlanner(surface=CostSurface(Roofline(SHAPE, 1.2e9, 2e10, 1.0)))
    planner.max_nodes, planner.explore_share = 8, 1.0  # every step may explore
    decisions: list[int] = []
    _drive(flat, 60, 16, planner, decisions)
    assert max(decisions) == 8 and decisions.count(8) >= 30, decisions
    assert planner.explored >= 1


def test_the_planner_keeps_what_each_fresh_decision_rested_on():
    """`decision_log`: every fresh decision (not one reused within `REFRESH_STEPS`), its choice,
    what it explored instead, and the tokens and seconds it compared, bounded in length."""
    planner = _planner()
    planner.explore_share = 0.05
    decisions: list[int] = []
    _drive(flat, 100, 16, planner, decisions)
    kept = list(planner.decision_log)
    assert 100 // REFRESH_STEPS <= len(kept) <= 100
    explored = [d for d in kept if d.explored is not None]
    assert len(explored) == planner.explored >= 1
    for d in kept:
        taken = decisions[d.step - 1]  # plan() counts steps from 1
        assert taken == (d.nodes if d.explored is None else d.explored)
        assert d.rows == 16 and d.context == CONTEXT and d.tokens[0] == 16.0
        assert d.tokens[1] >= d.tokens[0] and d.seconds[0] > 0 and d.sigma > 0
        assert d.best_tree is not None and d.best_tree[0] >= 1  # what a tree would have been
        if d.nodes > 0:
            assert d.best_tree[:3] == (d.nodes, d.tokens[1], d.seconds[1])
    assert kept[-1].nodes > 0  # on a flat device trees pay
    _drive(flat, 2000, 16, planner, decisions)
    assert len(planner.decision_log) == KEPT_DECISIONS


@pytest.mark.parametrize("rows, cap", [(12, 3), (16, 3), (32, 1), (64, 0)])
def test_no_tree_is_planned_past_the_graph_cap(rows, cap):
    """On a flat device the planner wants the whole budget; with `max_step_tokens` (a GPU's
    graph bucket limit) no padded step passes it, exploring included."""
    planner = SpeculationPlanner(surface=CostSurface(Roofline(SHAPE, 1.2e9, 2e10, 1.0)))
    planner.max_step_tokens, planner.explore_share = 64, 1.0
    decisions: list[int] = []
    _drive(flat, 40, rows, planner, decisions)
    assert planner.cap(rows) == cap and planner.cap(1) == 63
    assert max(decisions) == cap, decisions
    assert all(power_bucket(rows) * power_bucket(k + 1) <= 64 for k in decisions)


@pytest.mark.parametrize("change", ["flat-to-steep", "steep-to-flat"])
def test_the_planner_follows_a_step_change_and_explores_within_its_share(change):
    """A change of shape, not of speed (that the level follows at once): flat to steep is seen
    on the trees being drafted; steep to flat only by exploring, as stale evidence ages."""
    before, after = (flat, steep) if change == "flat-to-steep" else (steep, flat)
    planner, decisions = _planner(), []
    _drive(before, 400, 16, planner, decisions)
    _drive(after, 800, 16, planner, decisions)
    settle = 50 if after is steep else 500  # converged within this many steps of the change
    tail = decisions[400 + settle :]
    drafted = sum(k > 0 for k in tail)
    if after is steep:
        assert drafted <= 0.01 * len(tail) + 1, tail
    else:
        assert drafted >= 0.98 * len(tail), tail
    assert planner.explored <= 0.01 * planner.steps
    assert planner.explored >= 1  # the cautious bound alone would never have learned


def test_a_change_of_speed_moves_every_estimate_at_once():
    """Load on a shared machine slows every shape alike: the level follows it, so shapes not
    run meanwhile are priced slower too (most of the way in log terms within 30 steps; a
    shape's own offset takes the rest until it is timed again)."""
    s = _surface()
    for _ in range(30):
        for rows, width in [(16, 1), (16, 4)]:
            s.record(rows, width, CONTEXT, 2.0 * s.roofline.time(rows, width, CONTEXT))
    for _ in range(30):  # three times slower; only plain steps run
        s.record(16, 1, CONTEXT, 6.0 * s.roofline.time(16, 1, CONTEXT))
    moved = math.log(s.time(16, 4, CONTEXT) / (2.0 * s.roofline.time(16, 4, CONTEXT)))
    assert 0.5 * math.log(3.0) < moved <= math.log(3.0) + 0.05


def test_evidence_that_faded_out_is_neither_saved_nor_divided_by(tmp_path):
    s = _surface()
    s.path = tmp_path / "s.json"
    s.record(1, 1, CONTEXT, 0.05)
    for _ in range(2000):  # the first bucket's weight decays to nothing
        s.record(16, 1, CONTEXT, 0.1)
    s.save()
    data = json.loads(s.path.read_text())
    assert [b[:3] for b in data["buckets"]] == [[16, 1, 256]]
    data["buckets"].append([1, 1, 256, 0.0, 0.0])  # as an older file may hold it
    loaded = CostSurface.from_dict(data, SHAPE)
    assert loaded.time(1, 1, CONTEXT) > 0 and loaded.time(16, 1, CONTEXT) > 0
