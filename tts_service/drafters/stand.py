"""STAND: stochastic tree drafting from a logit n-gram store (Song et al. 2025;
docs/design.md, "STAND drafting").

At every node of a static tree shape the drafter looks up the longest stored n-gram of the
node's path context and draws the node's k children *without replacement* from the stored
distribution by Gumbel-Top-K (Kool et al. 2019): the top k of log q_i + G_i are a sample in
sequential-sampling order. The node keeps the snapshot `q` it drew from, so the recursive-
rejection verifier never re-reads the (shared, changing) store. Gumbel noise comes from a
precomputed buffer that is consumed once and refilled when empty, never reused.
After each verify forward the target's distributions at the root and the accepted nodes (the
last one is the bonus position), and optionally at rejected nodes, are merged into the store.

The product's `stand` drafts compiled (`stand_compiled`, the same trees node for node). This
Python drafter runs only where the kernel cannot serve or does not pay: over a Redis or tiered
store (the kernel walks an in-process store's arrays), with a noise buffer smaller than a step
can read, under `stand-spine` (which grows these trees below its spine), and on a CPU, where a
forward dwarfs the saving and loading the kernels costs a short run more (`DEVICE_FIELDS`). It
is also the reference the compiled drafter is tested against.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from types import MappingProxyType

from store.base import NgramStore
from store.indexed import IndexedStore
from tts_service.config import resolve_tree_path
from tts_service.drafters.base import ShapedTree, shape_prefix
from tts_service.drafters.gt import GT_STATS, gt_sized
from tts_service.drafters.gumbel import GumbelNoise, gumbel_top_k
from tts_service.drafters.spec import DraftEnv, DrafterSpec, Method, Shared
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.drafters.store_feed import feed_root, feed_store
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, SparseDist, TreeBuilder, load_tree_shape
from tts_service.engine.verify import Acceptance


class StandDrafter(Drafter):
    def __init__(self, cfg: StandDrafterConfig, store: NgramStore, seed: int = 0) -> None:
        self.cfg = cfg
        self.store = store
        self.shape = load_tree_shape(resolve_tree_path(cfg.tree))
        self.num_nodes = cfg.num_nodes
        self.noise = GumbelNoise(cfg.noise_buffer, seed)
        self._shape_ids: list[int] = [0]  # the tree being built: tree node -> shape node
        self._tails: list[tuple[int, ...]] = []  # last tree: context tail ending at each node

    def start(self, prompt_ids: list[int]) -> None:
        """Trajectories share the store; nothing is per-trajectory."""

    def draft(self, ctx: DraftContext) -> DraftTree:
        return self.draft_subtree(ctx, shape_prefix(self, ctx)).tree

    def draft_subtree(self, ctx: DraftContext, keep: Container[int]) -> ShapedTree:
        """Draft only the shape nodes in `keep` (closed under parents and earlier siblings)."""
        builder = self.new_tree(ctx)
        self.grow(builder, 0, keep, self.cfg.stochastic and not ctx.greedy)
        return ShapedTree(builder.build(), tuple(self._shape_ids))

    def new_tree(self, ctx: DraftContext) -> TreeBuilder:
        """A tree holding the root only; `hang` and `grow` add to it."""
        self._shape_ids, self._tails = [0], [tuple(ctx.tokens[-self.store.max_order :])]
        return TreeBuilder(ctx.tokens[-1])

    def hang(self, builder: TreeBuilder, parent: int, token: int) -> int:
        """Add a deterministic node that is not part of the shape (a spine token)."""
        self._shape_ids.append(-1)
        self._tails.append((*self._tails[parent], token)[-self.store.max_order :])
        return builder.add(parent, token)

    def grow(
        self,
        builder: TreeBuilder,
        at: int,
        keep: Container[int],
        stochastic: bool,
        exclude: int | None = None,
    ) -> None:
        """Hang the shape's nodes in `keep` below tree node `at` (the root, or a spine node
        whose spine child `exclude` is verified first and so is never drawn again)."""
        order = self.store.max_order
        placed = {0: at}  # shape node -> tree node
        for s in range(len(self.shape.parents)):
            node = placed.get(s)
            if node is None:
                continue
            kids = [c for c in self.shape.children[s] if c in keep]
            if not kids:
                continue
            entry = self.store.lookup(self._tails[node])
            if entry is None:
                continue
            skip = exclude if s == 0 else None
            cands = [
                (i, p) for i, p in zip(entry.ids, entry.probs, strict=True) if p > 0 and i != skip
            ]
            k = min(len(kids), len(cands))
            ids = [i for i, _ in cands]
            if stochastic:
                chosen = gumbel_top_k(ids, [p for _, p in cands], k, self.noise.take(len(ids)))
                # the full snapshot: the verifier removes already-tried siblings (the spine
                # token) itself, which is exactly the distribution `chosen` was drawn from
                builder.set_q(node, SparseDist(entry.ids, entry.probs))
            else:
                chosen = ids[:k]  # stored ids are sorted by probability
            for shape_child, token in zip(kids, chosen, strict=False):
                placed[shape_child] = builder.add(node, token, sampled=stochastic)
                self._shape_ids.append(shape_child)
                self._tails.append((*self._tails[node], token)[-order:])

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred:
        tails, harvest = self._tails, self.cfg.harvest_rejected  # the next draft rebinds them
        return lambda: feed_store(self.store, tails, tree, acc, topk, harvest)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred:
        tail = tuple(tokens[-self.store.max_order :])
        return lambda: feed_root(self.store, tail, topk)


KERNELS = "tts_service.drafters.stand_compiled"
"""The compiled drafter's module (its `warm()` loads the kernels)."""


def compiled_applies(cfg: StandDrafterConfig, store: NgramStore) -> bool:
    """Whether `stand_compiled` may draft for `cfg` over `store`: asked for, an in-process
    store (one that can index itself), and a noise buffer that holds what a step can read (every
    node opened, every stored id a candidate)."""
    if not cfg.compiled or not isinstance(store, IndexedStore):
        return False
    nodes = min(cfg.num_nodes, load_tree_shape(resolve_tree_path(cfg.tree)).num_nodes) + 1
    return cfg.noise_buffer >= nodes * store.topk


def _compiled_group(cfg: StandDrafterConfig, vocab: int):
    from tts_service.drafters.stand_compiled import new_group

    return new_group(cfg)


COMPILED_GROUP: Shared[StandDrafterConfig, object] = Shared(
    "stand.compiled_group", "problem", _compiled_group, key=lambda cfg: cfg.tree
)
"""One problem's compiled STAND rows over one tree shape: one kernel call a step."""


def _build(cfg: StandDrafterConfig, env: DraftEnv) -> Drafter:
    store = env.need_store(cfg.kind)
    index = store.compiled() if compiled_applies(cfg, store) else None  # type: ignore[attr-defined]
    if index is None:
        return gt_sized(StandDrafter(cfg, store, env.seed), cfg, env)
    from tts_service.drafters.stand_compiled import CompiledStand

    group = env.shared(COMPILED_GROUP, cfg)
    group.bind(index)
    return gt_sized(CompiledStand(cfg, store, group, env.seed), cfg, env)


SPEC = DrafterSpec(
    StandDrafterConfig,
    _build,
    methods=(
        Method("stand", "STAND: stochastic trees from the shared logit n-gram store"),
        Method(
            "stand-gt",
            "STAND, GT-sized by the measured verify cost",
            MappingProxyType({"sizing": "gt", "num_nodes": 80}),  # the whole tree is the cap
        ),
    ),
    size_field="num_nodes",
    needs_cost=True,
    uses_store=True,
    shared=(GT_STATS, COMPILED_GROUP),
    kernels=lambda cfg: KERNELS if cfg.compiled else None,
)
