"""What the user waits for: the process's age on the perf_counter clock, a run's stats split
into setup and decoding, and the status lines of slow phases."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tts_service.timing import TIMING_KEYS, phase, process_started, with_setup

AGE = (  # the sleep comes before the import: the fallback (the import's time) would miss it
    "import time; time.sleep(1.0); from tts_service.timing import process_started; "
    "print(time.perf_counter() - process_started())"
)


def test_the_process_age_counts_from_before_the_interpreter_ran():
    begun = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", AGE], capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - begun
    age = float(out.stdout)
    # the sleep and the interpreter's start, never more than the parent saw (10 ms ticks)
    assert 1.0 < age <= elapsed + 0.02
    assert process_started() < time.perf_counter()


def test_with_setup_splits_the_wall_time_into_setup_and_decoding():
    decoded = {"new_tokens": 40, "wall_s": 2.0, "tokens_per_s": 20.0, "acceptance_length": 1.5}
    stats = with_setup(decoded, time.perf_counter() - 8.0)
    assert stats["wall_s"] == pytest.approx(8.0, abs=0.05)
    assert stats["decode_s"] == 2.0
    assert stats["setup_s"] == pytest.approx(stats["wall_s"] - 2.0, abs=1e-9)
    assert stats["tokens_per_s"] == pytest.approx(40 / stats["wall_s"], rel=1e-3)
    assert stats["decode_tokens_per_s"] == 20.0
    assert stats["acceptance_length"] == 1.5 and set(TIMING_KEYS) <= set(stats)
    nothing = with_setup({"new_tokens": 0, "wall_s": 0.0}, time.perf_counter())
    assert nothing["decode_s"] == nothing["decode_tokens_per_s"] == 0.0  # a resume that ran none


def test_a_phase_says_when_it_starts_and_how_long_it_took(capsys):
    with phase("[tts] loading model m", "[tts] model loaded"):
        time.sleep(0.3)
    out, err = capsys.readouterr()
    start, done = err.splitlines()
    assert out == "" and start == "[tts] loading model m ..."
    assert done.startswith("[tts] model loaded in ") and done.endswith(" s")
    assert float(done.split(" in ")[1][:-2]) >= 0.3
