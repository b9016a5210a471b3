"""Counters of one trajectory (`GenerationStats`) and of a batch's forwards (`ForwardStats`);
rates are derived only at report time (`summarize`, the one report every edge prints; it lives
here, beside the counters, so that an edge that only reports, a job's driver, imports no model).

Acceptance length = committed tokens per target forward, the bonus token included (so plain
decoding has exactly 1.0). A row's `wall_s` is its own latency (join to finish); rows of one
batch overlap, so a run's speed is its total tokens over its real elapsed time, never a sum of
rows' walls.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TRACE_LEN = 4096
"""Forwards `ForwardStats.trace` keeps: a Serve replica's decoder lives for days."""


def acceptance_length(tokens: int, forwards: int) -> float:
    """Committed tokens per target forward, the bonus token included (plain decoding: 1.0);
    0.0 before the first forward. The one definition every report uses."""
    return tokens / forwards if forwards else 0.0


@dataclass
class GenerationStats:
    new_tokens: int = 0
    target_forwards: int = 0  # verify forwards that committed tokens (prefill excluded)
    tree_nodes: int = 0  # draft nodes sent to the target, root excluded
    plain_steps: int = 0  # forwards that sent no draft (nothing found, or not worth its cost)
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: steps accepting >= d
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def record_step(self, num_nodes: int, num_accepted: int, num_committed: int) -> None:
        self.target_forwards += 1
        self.tree_nodes += num_nodes
        self.plain_steps += num_nodes == 0
        self.new_tokens += num_committed
        if len(self.accepted_at_depth) < num_accepted:
            self.accepted_at_depth.extend([0] * (num_accepted - len(self.accepted_at_depth)))
        for d in range(num_accepted):
            self.accepted_at_depth[d] += 1

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.new_tokens, self.target_forwards)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "acceptance_length": round(self.acceptance_length, 4),
            "tree_nodes": self.tree_nodes,
            "plain_steps": self.plain_steps,
            "accepted_at_depth": list(self.accepted_at_depth),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


@dataclass
class ForwardStats:
    """Per-forward counters of a batch: what the device did, apart from any one row.

    A row's `GenerationStats` counts the forwards it took part in; these count the forwards
    themselves, so a 4-row step is one forward here and one row-forward in each of 4 rows."""

    forwards: int = 0
    row_forwards: int = 0  # sum over forwards of the rows in it
    tokens_sent: int = 0  # rows x padded tree width, summed: what the device computed
    draft_nodes: int = 0
    new_tokens: int = 0
    draft_s: float = 0.0  # drafting trees (none on plain steps)
    forward_s: float = 0.0  # pack, forward, verify, accept and KV compaction
    observe_s: float = 0.0  # drafters and the allocator learning from the step
    prefill_s: float = 0.0
    # per forward: (rows, width), the last TRACE_LEN forwards
    trace: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=TRACE_LEN))
    last_draft_s: float = 0.0
    last_forward_s: float = 0.0
    last_observe_s: float = 0.0
    last_context: int = 0  # cache slots attention spanned (before the step's tokens)

    def record(
        self,
        rows: int,
        width: int,
        nodes: int,
        tokens: int,
        draft_s: float,
        forward_s: float,
        observe_s: float = 0.0,
        context: int = 0,
    ) -> None:
        self.forwards += 1
        self.row_forwards += rows
        self.tokens_sent += rows * width
        self.draft_nodes += nodes
        self.new_tokens += tokens
        self.draft_s += draft_s
        self.forward_s += forward_s
        self.observe_s += observe_s
        self.trace.append((rows, width))
        self.last_draft_s, self.last_forward_s = draft_s, forward_s
        self.last_observe_s, self.last_context = observe_s, context

    @property
    def mean_rows_per_forward(self) -> float:
        return self.row_forwards / self.forwards if self.forwards else 0.0


PHASES = ("draft", "pack", "forward", "overlap", "verify", "accept", "kv", "observe")
"""The parts of one decode step, in order (`BatchDecoder.step`). `overlap` is the host work
that runs while the device computes the forward (the last step's deferred observation); the
others but `forward` are host work on the critical path between two forwards (`bench/host.py`
splits it by them)."""


class StepTimer:
    """One step's phase boundaries, marked by name in `PHASES`' order (`StepPhases.timer`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.start = clock()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """`phase` ends now."""
        self.marks[phase] = self.clock()

    @property
    def end(self) -> float:
        return self.marks[PHASES[-1]]

    def seconds(self, phase: str) -> float:
        i = PHASES.index(phase)
        return self.marks[phase] - (self.marks[PHASES[i - 1]] if i else self.start)

    def total(self) -> float:
        return self.end - self.start


@dataclass
class StepPhases:
    """Seconds spent in each phase of the decoder's steps, summed over steps (`PHASES`)."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def clock(self) -> float:
        """A phase boundary's reading (a profiling subclass may first wait for the device, so
        that each phase holds the device work it queued)."""
        return time.perf_counter()

    def timer(self) -> StepTimer:
        """A step's timer, reading this clock."""
        return StepTimer(self.clock)

    def record(self, timer: StepTimer) -> None:
        """One step, every phase marked in order."""
        assert tuple(timer.marks) == PHASES, tuple(timer.marks)
        self.steps += 1
        for name in PHASES:
            self.seconds[name] += timer.seconds(name)


def summarize(rows: Sequence[GenerationStats], forwards: ForwardStats, wall_s: float) -> dict:
    """The one report of a run that every edge prints (CLI, job summary, Serve, evaluation).

    `target_forwards` counts forwards of the device (a 4-row step is one); `acceptance_length`
    is committed tokens per row-forward (plain decoding: 1.0); `tokens_per_s` is all new
    tokens over the real elapsed time."""
    new_tokens = sum(r.new_tokens for r in rows)
    row_forwards = sum(r.target_forwards for r in rows)
    depth: list[int] = []
    for r in rows:
        for d, c in enumerate(r.accepted_at_depth):
            depth += [0] * (d + 1 - len(depth))
            depth[d] += c
    return {
        "num_trajectories": len(rows),
        "new_tokens": new_tokens,
        "target_forwards": forwards.forwards,
        "row_forwards": row_forwards,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": round(new_tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "mean_rows_per_forward": round(forwards.mean_rows_per_forward, 3),
        "acceptance_length": round(acceptance_length(new_tokens, row_forwards), 4),
        "tree_nodes": sum(r.tree_nodes for r in rows),
        "plain_steps": sum(r.plain_steps for r in rows),
        "accepted_at_depth": depth,
        "draft_s": round(forwards.draft_s, 4),
        "forward_s": round(forwards.forward_s, 4),
        "observe_s": round(forwards.observe_s, 4),
        "prefill_s": round(forwards.prefill_s, 4),
    }
