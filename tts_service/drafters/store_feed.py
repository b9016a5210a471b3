"""What the store learns after a verify forward (docs/design.md, "The logit n-gram store"): the
target's distributions at the root and the accepted nodes (the last one is the bonus
position), and optionally at rejected nodes, merged under each node's context. Shared by the
store drafters (`stand`, `stand_dyn`, `gtcp`) and the compiled ones (`stand_compiled`,
`stand_dyn_compiled`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from store.base import NgramRow, NgramStore
from tts_service.engine.seam import NodeTopK
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance

if TYPE_CHECKING:
    from store.index import StoreIndex


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
