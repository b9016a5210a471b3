"""The heartbeat's line: tokens and rate, rows, what is done, and the time left."""

from __future__ import annotations

import pytest

from jobs.heartbeat import Pulse, pulse_line, time_left


def _pulse(**kw) -> Pulse:
    base = dict(
        tokens=6000,
        rows=16,
        elapsed_s=60.0,
        trajectories=(0, 16),
        problems=(0, 1),
        finished_tokens=0,
        max_new_tokens=1000,
    )
    return Pulse(**(base | kw))


def test_before_any_trajectory_finishes_the_bound_is_max_new_tokens():
    seconds, word = time_left(_pulse())
    assert word == "at most" and seconds == pytest.approx((16_000 - 6000) / 100)
    line = pulse_line(_pulse())
    assert line == (
        "[job] decoding 60 s: 6,000 tokens (100.0 tok/s), 16 rows running, trajectories 0/16, "
        "problems 0/1, at most 2 min left"
    )


def test_once_some_finish_their_mean_length_estimates_the_rest():
    p = _pulse(trajectories=(4, 16), finished_tokens=2000, tokens=8000, elapsed_s=100.0)
    seconds, word = time_left(p)
    assert word == "about" and seconds == pytest.approx((16 * 500 - 8000) / 80)
    assert "about 0 s left" in pulse_line(p)


def test_no_rate_no_estimate_and_silent_actors_show_no_rows():
    assert time_left(_pulse(tokens=0)) is None
    line = pulse_line(_pulse(tokens=0, rows=None))
    assert "rows running" not in line and "left" not in line and "0 tokens" in line
    assert "1.5 h" in pulse_line(_pulse(elapsed_s=5400.0))


def test_rows_a_forward_say_whether_freed_rows_were_refilled():
    assert "16 rows running (13.9 a forward so far)" in pulse_line(_pulse(rows_per_forward=13.94))
