"""A private Ray never outlives its driver: `python -m actors.reaper PID` watches the driver PID
from a session of its own and, once it is gone however it ended (a clean exit, SIGTERM during
Ray's shutdown, kill -9), stops every process that was the driver's descendant the last time it
looked (GCS, raylet, the dashboard and runtime-env agents, workers), SIGTERM then SIGKILL.

Ray ties its head processes to the driver, but not the agents the raylet starts: they outlived a
killed driver by a minute and more. The processes are read from /proc (Linux); a process is
matched by its start time too, so a PID reused meanwhile is never signalled. Elsewhere the
reaper exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LOOK_EVERY_S = 0.5
GRACE_S = 3.0  # from SIGTERM to SIGKILL

Processes = dict[int, tuple[int, int]]
"""pid -> (parent pid, start time in clock ticks since boot)."""


def process_table(proc: Path = Path("/proc")) -> Processes:
    """Every process now, from /proc/PID/stat."""
    table: Processes = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            stat = _stat(entry)
            if stat is not None:
                table[int(entry.name)] = stat
    return table


def _stat(entry: Path) -> tuple[int, int] | None:
    """(parent pid, start time) of a running process; None if it has ended (a zombie too)."""
    try:
        text = (entry / "stat").read_text()
    except OSError:  # it ended while we looked
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return None if fields[0] in "ZX" else (int(fields[1]), int(fields[19]))


def descendants(root: int, table: Processes) -> dict[int, int]:
    """The processes below `root` in `table`, each with its start time."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


def still_running(tracked: dict[int, int]) -> list[int]:
    """Those of `tracked` that are the same processes still (their start time unchanged)."""
    running = []
    for pid, start in tracked.items():
        stat = _stat(Path(f"/proc/{pid}"))
        if stat is not None and stat[1] == start:
            running.append(pid)
    return running


def stop(tracked: dict[int, int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to every process of `tracked` still running, SIGKILL to those left after
    `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in still_running(tracked):
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while still_running(tracked) and time.monotonic() < deadline:
            time.sleep(0.1)


def watch(driver: int) -> None:
    """Follow the driver's descendants until it ends, then stop those last seen."""
    me = os.getpid()
    born = process_table().get(driver, (0, -1))[1]
    tracked: dict[int, int] = {}
    while True:
        table = process_table()
        if table.get(driver, (0, -2))[1] != born:  # gone (or its PID reused)
            break
        tracked = {p: s for p, s in descendants(driver, table).items() if p != me}
        time.sleep(LOOK_EVERY_S)
    stop(tracked)


def start(driver: int | None = None) -> subprocess.Popen | None:
    """The reaper of `driver` (this process by default), in a session of its own; None where
    there is no /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", __name__, str(driver or os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
