"""GTCP's Greater-Than principle applied to our drafters (engine/cost.py;
docs/design.md, "GT sizing and GTCP").

Two ways, both driven by the verify cost measured on the running device (the second in
`drafters/gtcp.py`):

* `GtSizedDrafter` prunes a static tree (STAND's, Token Recycling's). α̂ of a shape node is
  its on-path frequency: the calibrated `on_path_frequency` of the tree file (or 0.5^depth)
  as a prior, replaced online by how often the node was accepted over the last ~50 times it
  was drafted (one step in 8 offers twice the kept tree plus 8, so nodes pruned while the store
  was cold are measured again as it warms: α̂ grows with the store, and the tree with it).
  The kept nodes are the best by α̂, closed under parents and earlier siblings; how many is
  the count with the best expected tokens per second.
* `GtTreeDrafter` builds a dynamic tree best first over STAND's store: a node's α̂ is the
  product of the stored draft probabilities along its path, and expansion stops when no larger
  tree could beat the current expected rate.

Under sampling, which children a node gets is decided before they are drawn (slot j of a node
is scored by the node's j-th best stored probability), and children are drawn in Gumbel order,
so each is a draw without replacement from the snapshot `q`, as the RRS verifier requires; the
decision to stop may depend on earlier draws only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tts_service.config import resolve_tree_path
from tts_service.drafters.base import StaticTreeDrafter, shape_prefix
from tts_service.drafters.spec import DraftEnv, Shared
from tts_service.engine.cost import VerifyCostSource, gt_count
from tts_service.engine.rates import smoothed_rate
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, select_subtree
from tts_service.engine.verify import Acceptance

PRIOR_WEIGHT = 1.0  # the prior frequency counts as one draft: evidence takes over at once
DECAY = 0.98  # per draft: a node's counts cover the last ~50 times it was drafted
EXPLORE_EVERY = 8  # one step in this many offers twice the kept tree (+8), to re-measure
EXPLORE_EXTRA = 8


class OnPathStats:
    """α̂ per shape node: how often it was on the accepted path when drafted, with the tree
    file's frequency as a prior.

    Shared by the trajectories (and batch rows) of one problem, whose store they measure.
    """

    def __init__(self, prior: list[float]) -> None:
        n = len(prior)
        self.prior = list(prior)
        if n < 1 or prior[0] != 1.0:
            raise ValueError("on_path_frequency: the root's entry comes first and is 1.0")
        self.hits = [0.0] * n
        self.drafted = [0.0] * n

    def alphas(self) -> list[float]:
        """α̂ per shape node (the root's is 1)."""
        return [
            smoothed_rate(h, o, p, PRIOR_WEIGHT)
            for h, o, p in zip(self.hits, self.drafted, self.prior, strict=True)
        ]

    def record(self, drafted: list[int], accepted: list[int]) -> None:
        """One step: shape nodes `drafted` were in the tree, `accepted` were on the path."""
        for v in drafted:
            self.hits[v] *= DECAY
            self.drafted[v] = self.drafted[v] * DECAY + 1.0
        for v in accepted:
            self.hits[v] += 1.0


class GtSizedDrafter(Drafter):
    """A static-tree drafter whose tree size is re-chosen every step by the GT rule."""

    def __init__(
        self, inner: StaticTreeDrafter, cost: VerifyCostSource, stats: OnPathStats
    ) -> None:
        if len(stats.prior) != inner.shape.num_nodes + 1:  # one entry per node, root first
            raise ValueError("the on-path statistics belong to another tree")
        self.inner = inner
        self.cost = cost
        self.stats = stats
        self.kept = 0  # nodes the GT rule kept in the last step
        self.threshold = 0.0  # the last step's α̂ cut-off (the last kept node's α̂)
        self.steps = 0
        self.offered_now = 0  # slots offered this step: `kept`, or more to explore
        self._offered: list[int] = []  # their shape ids (the store may fill fewer)
        self._shape_ids: tuple[int, ...] = (0,)  # the last tree's: tree node -> shape node

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        alphas = self.stats.alphas()
        cap = len(shape_prefix(self.inner, ctx))
        # best first, closed under parents and earlier siblings; along that order α̂ is made
        # non-increasing (a node needs the ones before it to be reached)
        order = select_subtree(self.inner.shape, alphas, cap)[1:]
        ranked, low = [], 1.0
        for v in order:
            low = min(low, alphas[v])
            ranked.append(low)
        self.kept = cap if ctx.fill else gt_count(ranked, self.cost.at(len(ctx.tokens)), cap)
        self.threshold = ranked[self.kept - 1] if self.kept else 1.0
        self.steps += 1
        explore = self.steps % EXPLORE_EVERY == 1
        self.offered_now = min(cap, 2 * self.kept + EXPLORE_EXTRA) if explore else self.kept
        self._offered = order[: self.offered_now]
        shaped = self.inner.draft_subtree(ctx, frozenset(self._offered))
        self._shape_ids = shaped.shape_ids
        return shaped.tree

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        # counted over the nodes really drafted: a slot the store could not fill costs nothing,
        # so a cold store must not drag α̂ down for later, when it can
        self.stats.record(list(self._shape_ids[1:]), [self._shape_ids[v] for v in acc.path])
        return self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        return self.inner.observe_root(tokens, topk)


def new_gt_stats(cfg: Any) -> OnPathStats:
    """Fresh on-path statistics for a static tree (`cfg.tree`): its calibrated frequency as the
    prior, or 0.5^depth for a tree file without one (Token Recycling's template)."""
    data = json.loads(resolve_tree_path(cfg.tree).read_text(encoding="utf-8"))
    freq = data.get("on_path_frequency")
    if isinstance(freq, list):
        return OnPathStats([float(f) for f in freq])
    depth = [0]
    for p in data["parents"][1:]:
        depth.append(depth[p] + 1)
    return OnPathStats([0.5**d for d in depth])


GT_STATS: Shared[Any, OnPathStats] = Shared(
    "gt_stats",
    "problem",
    lambda cfg, vocab: new_gt_stats(cfg),
    key=lambda cfg: cfg.model_dump_json(),
)
"""GT sizing's on-path statistics: one per problem and static-tree config."""


def gt_sized(inner: StaticTreeDrafter, cfg: Any, env: DraftEnv) -> Drafter:
    """A static-tree drafter pruned by the GT rule when `cfg.sizing` is "gt" (its on-path
    statistics shared by the problem's trajectories), else `inner` itself."""
    if cfg.sizing == "fixed":
        return inner
    return GtSizedDrafter(inner, env.need_cost(cfg.kind), env.shared(GT_STATS, cfg))
