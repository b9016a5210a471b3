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
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Container, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np
from pydantic import Field

from store.base import IndexedStore, NgramRow, NgramStore
from tts_service.config import Sizing, StrictConfig, TreeName, resolve_tree_path
from tts_service.drafters.base import ShapedTree, shape_prefix
from tts_service.drafters.gt import GT_STATS, gt_sized
from tts_service.drafters.spec import DraftEnv, DrafterSpec, Method, Shared
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.streams import Stream, stream_seed
from tts_service.engine.tree import DraftTree, SparseDist, TreeBuilder, load_tree_shape
from tts_service.engine.verify import Acceptance

if TYPE_CHECKING:
    from store.index import StoreIndex


class StandDrafterConfig(StrictConfig):
    """STAND (Song et al. 2025): stochastic trees drawn from a shared logit n-gram store."""

    kind: Literal["stand"] = "stand"
    tree: TreeName = Field("stand-80", description="A name in configs/trees or a JSON path.")
    num_nodes: int = Field(16, ge=1, le=1024, description="Use the tree's first N nodes.")
    stochastic: bool = Field(True, description="Gumbel-Top-K children; False: top-k (ablation).")
    harvest_rejected: bool = Field(
        False, description="Also store the target's distributions at rejected tree nodes."
    )
    noise_buffer: int = Field(4096, ge=16, description="Gumbel noise values drawn per refill.")
    sizing: Sizing = "fixed"
    compiled: bool = Field(
        True,
        description="Draft with the compiled kernel (`stand_compiled`, numba) where it applies: "
        "the same trees, a fraction of the host time.",
    )


class GumbelNoise:
    """A buffer of Gumbel(0, 1) noise: every value is handed out once; refilled when short.

    It reads the draft stream of trajectory `seed`, never the verifier's (`engine.streams`).
    The noise is host data, so it is drawn with numpy: a torch refill dispatched six ops on
    tiny tensors, one refill per row every few hundred nodes, which made the host's op count
    grow with the rows (issue 27). The Python drafter takes floats (`take`); the compiled one
    reads a window of the buffer and of the next one (`window`, `advance`), drawn early from
    the same stream, so both see the same values in the same order.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.rng = np.random.Generator(np.random.PCG64(stream_seed(seed, Stream.DRAFT)))
        self.array = np.zeros(0)  # the current buffer
        self.values: list[float] | None = []  # the same as floats, made at `take`'s need
        self.ahead: np.ndarray | None = None  # the next buffer, once a window asked for it
        self.pos = 0
        self.refills = 0

    def _refill(self, n: int) -> None:
        ahead, self.ahead = self.ahead, None
        assert ahead is None or len(ahead) >= n, "a window's next buffer holds what it read"
        self.array = ahead if ahead is not None else self._draw(n)
        self.values = None
        self.pos = 0
        self.refills += 1

    def _draw(self, n: int) -> np.ndarray:
        return self.rng.gumbel(size=max(self.size, n))

    def take(self, n: int) -> list[float]:
        if self.pos + n > len(self.array):  # the tail is discarded, never wrapped around
            self._refill(n)
        if self.values is None:
            self.values = self.array.tolist()
        out = self.values[self.pos : self.pos + n]
        self.pos += n
        return out

    def window(self, need: int) -> tuple[np.ndarray, int, np.ndarray]:
        """What a compiled draft reading at most `need` values (≤ `size`) sees: the buffer's
        next values, how many it has left, and the next buffer's first where the read may run
        past this one (else none: drawn when first needed, the stream's same values)."""
        assert need <= self.size, "a step may read no more than a buffer holds"
        rest, left = self.array[self.pos : self.pos + need], len(self.array) - self.pos
        if left >= need:
            return rest, left, rest[:0]
        if self.ahead is None:
            self.ahead = self._draw(need)
        return rest, left, self.ahead[:need]

    def advance(self, refilled: bool, pos: int) -> None:
        """After a compiled draft: it moved to the next buffer (then read `pos` of it), or read
        `pos` more of this one."""
        if refilled:
            self._refill(0)
        self.pos += pos


def gumbel_top_k(ids: list[int], probs: list[float], k: int, noise: list[float]) -> list[int]:
    """k ids sampled without replacement from `probs` (any positive scale), in sampling order."""
    keys = [math.log(p) + g for p, g in zip(probs, noise, strict=True)]
    order = sorted(range(len(ids)), key=lambda i: -keys[i])
    return [ids[i] for i in order[:k]]


class StandDrafter:
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


def feed_root(store: NgramStore, tokens: Sequence[int], topk: NodeTopK) -> None:
    """Merge the target's distribution at a plain step's root under its context tail."""
    if topk.has(0):
        tail = tuple(tokens[-store.max_order :])
        store.add([NgramRow(tail, tuple(topk.ids[0].tolist()), tuple(topk.probs[0].tolist()))])


def feed_index(
    index: StoreIndex,
    contexts: tuple[np.ndarray, np.ndarray],
    nodes: list[int],
    topk: NodeTopK,
) -> None:
    """`feed_store` on a store's arrays (the compiled drafters'): the target's distributions at
    `nodes` (`learned_nodes`), under each node's context (`contexts`: right-aligned, -1
    padded, and their lengths, per tree node)."""
    if nodes:
        rows = np.array(nodes, np.int64)
        ctx, clen = contexts
        width = np.full(len(rows), topk.ids.shape[1], np.int64)
        index.add_arrays(ctx[rows], clen[rows], topk.ids[rows], topk.probs[rows], width)


def learned_nodes(
    tree: DraftTree, acc: Acceptance, topk: NodeTopK, harvest_rejected: bool
) -> list[int]:
    """The nodes whose target distributions the store learns, in merge order: the root and the
    accepted nodes (the last one is the bonus position), then, with `harvest_rejected`, the
    rejected ones; only those with a real top-k row."""
    nodes = [0, *acc.path]
    if harvest_rejected:
        on_path = set(acc.path)
        nodes += [v for v in range(1, tree.size) if v not in on_path]
    return [v for v in nodes if topk.has(v)]


def feed_store(
    store: NgramStore,
    tails: list[tuple[int, ...]],
    tree: DraftTree,
    acc: Acceptance,
    topk: NodeTopK,
    harvest_rejected: bool,
) -> None:
    """Merge the target's distributions at `learned_nodes` under each node's context tail."""
    nodes = learned_nodes(tree, acc, topk, harvest_rejected)
    ids, probs = topk.ids[nodes].tolist(), topk.probs[nodes].tolist()
    store.add(
        [NgramRow(tails[v], tuple(i), tuple(p)) for v, i, p in zip(nodes, ids, probs, strict=True)]
    )


def compiled_applies(cfg: StandDrafterConfig, store: NgramStore) -> bool:
    """Whether `stand_compiled` may draft for `cfg` over `store`: asked for, an in-process
    store (one that can index itself), a noise buffer that holds what a step can read (every
    node opened, every stored id a candidate), and numba importable."""
    if not cfg.compiled or not isinstance(store, IndexedStore):
        return False
    nodes = min(cfg.num_nodes, load_tree_shape(resolve_tree_path(cfg.tree)).num_nodes) + 1
    if cfg.noise_buffer < nodes * store.topk:
        return False
    return importlib.util.find_spec("numba") is not None


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
)
