"""A job's heartbeat: every `HEARTBEAT_S` while its actors decode, one line of what they are
doing (a real reasoning trajectory runs for minutes, and a job prints a line per finished one):
tokens so far and their rate, rows running, trajectories and problems done, and the time left."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

HEARTBEAT_S = 30.0
"""How often a decoding job says how it is doing."""
POLL_S = 5.0
"""How long the heartbeat waits for the actors' counts (a busy actor answers in its own
concurrency group; one that does not answer is left out of that line)."""


@dataclass(frozen=True)
class Pulse:
    """What one heartbeat line reports."""

    tokens: int  # committed since the run's actors were ready, rows in flight included
    rows: int | None  # rows decoding now (None: no actor answered)
    elapsed_s: float
    trajectories: tuple[int, int]  # done, total
    problems: tuple[int, int]
    finished_tokens: int  # of the trajectories done
    max_new_tokens: int
    rows_per_forward: float | None = None  # since the heartbeat began (None: unknown)


def time_left(p: Pulse) -> tuple[float, str] | None:
    """(seconds, 'about' or 'at most') still to decode: the finished trajectories' mean length
    for the rest, else every trajectory at `max_new_tokens`; None before any rate."""
    if p.tokens <= 0 or p.elapsed_s <= 0:
        return None
    done, total = p.trajectories
    mean, word = (p.finished_tokens / done, "about") if done else (p.max_new_tokens, "at most")
    left = max(total * mean - p.tokens, 0.0)
    return left / (p.tokens / p.elapsed_s), word


def pulse_line(p: Pulse) -> str:
    rate = p.tokens / p.elapsed_s if p.elapsed_s > 0 else 0.0
    rows = "" if p.rows is None else f", {p.rows} rows running"
    if p.rows_per_forward is not None:
        rows += f" ({p.rows_per_forward:.1f} a forward so far)"
    left = time_left(p)
    eta = "" if left is None else f", {left[1]} {_duration(left[0])} left"
    return (
        f"[job] decoding {_duration(p.elapsed_s)}: {p.tokens:,} tokens ({rate:.1f} tok/s){rows}, "
        f"trajectories {p.trajectories[0]}/{p.trajectories[1]}, "
        f"problems {p.problems[0]}/{p.problems[1]}{eta}"
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Heartbeat:
    """A thread printing `pulse_line` every `every_s` until the block ends. `actors`: those that
    answer `progress()` (generator actors; a tensor-parallel replica's tokens show as its
    trajectories finish); `progress`: the job's `jobs.common.Progress`."""

    def __init__(self, actors: list, progress, max_new_tokens: int, every_s: float | None = None):
        self.actors, self.progress = actors, progress
        self.every_s = HEARTBEAT_S if every_s is None else every_s
        self.max_new_tokens = max_new_tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tts-heartbeat", daemon=True)
        self._base: dict[str, int] = {}
        self._began = time.perf_counter()

    def __enter__(self) -> Heartbeat:
        self._base = self._poll()  # the actors may have decoded an earlier task already
        self._began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, kind, error, tb) -> None:
        self._stop.set()
        self._thread.join(timeout=POLL_S + 1)
        if kind is None and self.actors:  # how full the batch stayed: freed rows refilled?
            pulse = self.pulse()
            if pulse.rows_per_forward is not None:
                print(f"[job] decoded: {pulse.rows_per_forward:.1f} rows a forward", flush=True)

    def _poll(self) -> dict[str, int]:
        """Rows, tokens, forwards and rows a forward, summed over the actors that answered
        within `POLL_S` (no `rows` when none did)."""
        import ray

        refs = [a.progress.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
        counts = []
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):  # dead: the pool retries its work
                counts.append(ray.get(ref))
        if not counts:
            return {}
        return {key: sum(c.get(key, 0) for c in counts) for key in counts[0]}

    def pulse(self) -> Pulse:
        now, base, prog = self._poll(), self._base, self.progress
        finished = prog.tokens
        since = {k: v - base.get(k, 0) for k, v in now.items()}
        forwards = since.get("forwards", 0)
        return Pulse(
            max(since["tokens"], finished) if now else finished,
            now.get("rows"),
            time.perf_counter() - self._began,
            (prog.trajectories, prog.totals[0]),
            (prog.problems, prog.totals[1]),
            finished,
            self.max_new_tokens,
            since["row_forwards"] / forwards if forwards > 0 else None,
        )

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            print(pulse_line(self.pulse()), flush=True)
