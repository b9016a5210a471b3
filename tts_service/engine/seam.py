"""The seam between the engine and the drafters: what a drafter sees at a step, what it is
asked, and how its deferred observation and grouped drafting run. The engine owns it; the
drafters import it (the engine never imports a drafter).

The engine never checks a drafter's type. A drafter may keep any state (a PLD index, a
successor table, a shared store); none of it can change what is committed, only how fast.

Observation may be deferred: `observe` and `observe_root` may return a `Deferred`, the part of
the work that can wait (store updates, calibration, successor tables), and the engine runs it
during the next step's forward, after the next `draft` (docs/design.md, "Observation off the
critical path"). What `observe` itself does must capture any per-tree state the next `draft`
overwrites.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

Deferred = Callable[[], None]
"""Observation work a drafter lets wait until the next step's forward is running."""


class DeferredObservations:
    """What the drafters deferred of observing a step, run in the order they deferred it: by
    the engine during the next step's forward (`engine.batch.BatchDecoder`), by replay after the
    next drafts (`replay.LoggedDecoder`)."""

    def __init__(self) -> None:
        self._work: list[Deferred] = []

    def __bool__(self) -> bool:
        return bool(self._work)

    def add(self, later: Deferred | None) -> None:
        if later is not None:
            self._work.append(later)

    def run(self) -> None:
        work, self._work = self._work, []
        for later in work:
            later()


OBSERVE_TAIL = 64
"""Tokens of a plain step's context `observe_root` gets: the context's last ones (drafters read
a short suffix; copying a 16k-token context per row per step is what must not happen)."""


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees at one step."""

    tokens: list[int]  # prompt + committed tokens; tokens[-1] is the tree's root
    prompt_len: int
    max_nodes: int  # draft nodes allowed this step, root excluded
    greedy: bool = False  # the verifier takes the argmax: sampled children buy nothing
    # the runner explores this size (`SpeculationPlanner`): send the whole budget, whatever
    # the drafter's own sizing says, or the step times a shape nobody asked for
    fill: bool = False


@dataclass(frozen=True)
class NodeTopK:
    """Top-k of the target's distribution at every tree node (after temperature and filters).

    Host arrays (numpy, copied out of the step's one copy back): the drafters read them on the
    host, and tensors would add dispatched ops per step for nothing."""

    ids: np.ndarray  # [n, k] int64
    probs: np.ndarray  # [n, k] float64
    known: tuple[int, ...] | None = None  # nodes whose rows are real (None: all); replay

    def has(self, node: int) -> bool:
        return self.known is None or node in self.known


class Drafter(Protocol):
    def start(self, prompt_ids: list[int]) -> None:
        """A new trajectory begins (per-sequence state resets; shared state persists)."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        """Propose a tree rooted at `ctx.tokens[-1]` with at most `ctx.max_nodes` drafts."""

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        """Learn from one verify forward: the tree sent, what was accepted, the target's top-k;
        return what may wait for the next forward, if anything."""

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        """Learn from a plain step, where the allocator gave no nodes and `draft` was not
        called: the target's top-k (one row) at the root `tokens[-1]`, after `tokens` (the
        context's last `OBSERVE_TAIL` tokens)."""

    def grouped(self) -> tuple[DraftGroup, object] | None:
        """(group, member) when this drafter drafts a step together with others in one call
        (`draft_all`); by default None: it drafts alone. A wrapper that changes what its inner
        drafter drafts (GT sizing's subtrees) keeps the default."""
        return None


class DraftGroup(Protocol):
    """Rows whose drafters share one compiled state draft a step in one call."""

    def draft_all(self, members: Sequence, ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        """The members' trees, exactly as each drafting in turn (in this order) would make
        them."""


def draft_all(drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
    """Every row's tree: grouped drafters in one call per group (rows in order within it),
    the others one by one. Groups share no state with other drafters, so this is what
    drafting row after row gives."""
    trees: list[DraftTree | None] = [None] * len(drafters)
    groups: dict[int, tuple[DraftGroup, list[int], list]] = {}
    for b, (drafter, ctx) in enumerate(zip(drafters, ctxs, strict=True)):
        found = drafter.grouped()
        if found is None:
            trees[b] = drafter.draft(ctx)
        else:
            entry = groups.setdefault(id(found[0]), (found[0], [], []))
            entry[1].append(b)
            entry[2].append(found[1])
    for group, rows, members in groups.values():
        for b, tree in zip(rows, group.draft_all(members, [ctxs[b] for b in rows]), strict=True):
            trees[b] = tree
    return trees  # type: ignore[return-value]
