"""The `Drafter` seam: propose a tree from the context, observe what the target said.

The engine never checks a drafter's type. A drafter may keep any state (a PLD index, a
successor table, a shared store); none of it can change what is committed, only how fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees at one step."""

    tokens: list[int]  # prompt + committed tokens; tokens[-1] is the tree's root
    prompt_len: int
    max_nodes: int  # draft nodes allowed this step, root excluded
    greedy: bool = False  # the verifier takes the argmax: sampled children buy nothing


@dataclass(frozen=True)
class NodeTopK:
    """Top-k of the target's distribution at every tree node (after temperature and filters)."""

    ids: torch.Tensor  # [n, k] long
    probs: torch.Tensor  # [n, k] float64
    known: tuple[int, ...] | None = None  # nodes whose rows are real (None: all); replay

    def has(self, node: int) -> bool:
        return self.known is None or node in self.known


class Drafter(Protocol):
    def start(self, prompt_ids: list[int]) -> None:
        """A new trajectory begins (per-sequence state resets; shared state persists)."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        """Propose a tree rooted at `ctx.tokens[-1]` with at most `ctx.max_nodes` drafts."""

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        """Learn from one verify forward: the tree sent, what was accepted, the target's top-k."""
