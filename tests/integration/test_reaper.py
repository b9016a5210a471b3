"""A private Ray never outlives its driver: the reaper stops what a driver started once the
driver is gone, however it ended (kill -9 here), and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from actors import reaper


def test_descendants_follow_the_tree_from_the_root():
    table = {10: (1, 100), 11: (10, 101), 12: (11, 102), 13: (1, 103), 14: (13, 104)}
    assert reaper.descendants(10, table) == {11: 101, 12: 102}
    assert reaper.descendants(12, table) == {}


def test_a_killed_driver_s_processes_end_within_seconds_and_no_others():
    """A driver whose child starts a grandchild in a session of its own (as Ray's agents run),
    killed with SIGKILL: both end within a few seconds; a process beside it lives on."""
    grandchild = "import time; time.sleep(120)"
    child = (
        "import subprocess, sys, time;"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True);"
        "time.sleep(120)"
    )
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]);"
    driver = subprocess.Popen([sys.executable, "-c", parent + "time.sleep(120)"])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watcher = reaper.start(driver.pid)
    try:
        deadline = time.monotonic() + 20
        while len(psutil.Process(driver.pid).children(recursive=True)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        below = psutil.Process(driver.pid).children(recursive=True)
        time.sleep(2 * reaper.LOOK_EVERY_S)  # the reaper has seen them
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs(below, timeout=reaper.GRACE_S + 5)
        assert not alive, [p.cmdline() for p in alive]
        watcher.wait(timeout=10)
        assert bystander.poll() is None
    finally:
        for p in (driver, bystander):
            if p.poll() is None:
                p.kill()
                p.wait()
