"""Lossless acceptance for every row's draft tree at once.

`engine.verify` walks one tree on the host, node by node; that is the reference. Here the same
rules, (a) greedy and (b) sample-and-match over deterministic drafts, run for the whole batch
on the device in a fixed number of tensor ops (whatever the row count and tree shapes), so a
GPU host launches a few dozen kernels per step and copies one result back:

* `treepack.TreeBatch.of`: tokens, parents, depths, the parents' flat indices and positions
  `[R, N]` from the trees (one host-to-device copy) and the ancestor and earlier-sibling masks
  `[R, N, N]` (another; unpacked on the host from each tree shape's bit rows,
  `treepack.shape_rows`), which the attention mask and the acceptance read.
* `greedy_choice` / `match_choice`: which child each node accepts, if any. Rule (b): a child
  x_i, the first of its token among its siblings, is accepted with probability
  p(x_i) / (p(x_i) + the mass of its later siblings + the node's residual mass), the mass not yet
  rejected summed from what is left, so a child holding all of it is accepted with probability
  exactly 1; the residual bonus is drawn per node up front (its residual is known before the
  walk), as `verify.draw_match` does.
* `accepted_path`: the deepest node whose whole path was chosen, and that path.
* `verdict`: all of it and the drafters' top-k in the one tensor the host copies back;
  `step_verdict` computes it from the step's device tensors alone, which is what a CUDA graph
  captures (`graphs.GraphedAcceptance`).

The uniforms come from `streams.counter_uniforms`: a function of (the row's seed, the root's
position, the node), so a row's draws do not depend on the batch it is in, and one call serves
every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from tts_service.engine.sampling import SamplingParams, store_probs
from tts_service.engine.tree import DraftTree, DrawnBatch
from tts_service.engine.treepack import TreeBatch
from tts_service.engine.verify import TINY, Acceptance


def greedy_choice(batch: TreeBatch, best: torch.Tensor) -> torch.Tensor:
    """Rule (a): the child holding the argmax `best` (`[R, N]`) of its parent."""
    return batch.firsts & (batch.tokens == batch.at_parent(best))


RESIDUAL_ROUNDING = 64 * 2.0**-52
"""A node's residual mass, relative to p's, below which it is rounding (`residual_mass`): the
sums of a few dozen children's p in two orders differ by far less."""


def match_choice(
    batch: TreeBatch, p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule (b) over deterministic drafts, with `p` `[R, N, V]` float64 and uniforms `u`
    `[R, N]`: (the chosen children `[R, N]` bool, each draft node's p at its parent `[R, N]`,
    0 for a duplicate sibling: what `residual_at` takes out of the residual)."""
    before, firsts, at = batch.siblings_before, batch.firsts, batch.parent_at
    flat = p.flatten(0, 1)
    px = torch.where(firsts, flat[at, batch.tokens], 0.0)
    later = before.transpose(1, 2)  # (i, j): j is a later sibling of i
    left = px + (later * px[:, None, :]).sum(-1) + batch.at_parent(residual_mass(batch, p, px))
    threshold = torch.where(left > TINY, px / left, 0.0)
    passed = firsts & (u < threshold)
    chosen = passed & ~(before & passed[:, None, :]).any(-1)
    return chosen, px


def residual_mass(batch: TreeBatch, p: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """`[R, N]`: each node's p less its children's (`px` at their parent), without building the
    `[R, N, V]` residual (on a 49k vocabulary that copy was a sixth of a step's acceptance).
    What is left within `RESIDUAL_ROUNDING` of p's mass is rounding, and reads exactly 0: where
    every token of p's support was drafted as a child (the residual is empty) the children's
    thresholds then reach exactly 1, and no bonus is drawn from an empty residual. A true
    residual that small (a relative 1e-14) is taken as empty too, an error far below float64
    p's own rounding at every entry; elsewhere the mass differs from the residual's own sum in
    the last bits."""
    rows, n = batch.shape
    drafted = torch.zeros(rows * n, dtype=p.dtype, device=p.device)
    drafted = drafted.index_add_(0, batch.parent_at.flatten(), px.flatten()).view(rows, n)
    total = p.sum(-1)
    left = total - drafted
    return torch.where(left > RESIDUAL_ROUNDING * total, left, 0.0)


def residual_at(
    batch: TreeBatch, p: torch.Tensor, px: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """`[R, V]`: p at each row's node `last` without its children's tokens (`px`, from
    `match_choice`), the distribution its bonus is drawn from; the same arithmetic as taking
    each child's p away from the whole row."""
    rows = torch.arange(batch.shape[0], device=last.device)
    mine = batch.parents == last[:, None]  # the last node's children (pads: parent -1)
    take = torch.where(mine, -px, 0.0)
    at = rows[:, None].expand_as(batch.tokens)
    return p[rows, last].index_put((at, batch.tokens), take, accumulate=True)


def residual_bonus(residual: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A token drawn from each residual (`[..., V]`, any positive scale; `v` `[...]`) by
    inverting its CDF at the uniform `v`; ids with zero mass are never drawn."""
    cdf = residual.cumsum(-1)
    total = cdf[..., -1:]
    x = torch.minimum(v[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).clamp_(max=residual.shape[-1] - 1)[..., 0]


def outside_support(
    p: torch.Tensor, support: torch.Tensor, empty: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the host walk of rule (c) needs of p at a node (`verify.SparseNode`): p `[..., V]`
    on the node's support `[..., K]` (ids; an `empty` support `[...]` pads with any id), p's
    mass outside the support `[...]`, and a token drawn from p outside it at the uniform `v`."""
    outside = torch.where(empty[..., None], p, p.scatter(-1, support, 0.0))
    return p.gather(-1, support), outside.sum(-1), residual_bonus(outside, v)


def accepted_path(batch: TreeBatch, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the deepest node `[R]` whose every non-root node on its path was chosen, that path
    `[R, N]` bool, root included). Chosen children are one per node at most, so it is one."""
    unchosen = batch.draft ^ chosen  # chosen children are draft nodes
    blocked = (batch.ancestors & unchosen[:, None, :]).any(-1)
    ok = batch.real & ~blocked
    last = torch.where(ok, batch.depths, -1).argmax(-1)
    on_path = batch.ancestors[torch.arange(batch.shape[0], device=last.device), last]
    return last, on_path


def accept_all(
    tb: TreeBatch,
    probs: torch.Tensor,
    best: torch.Tensor,
    uv: tuple[torch.Tensor, torch.Tensor] | None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rules (a) and (b) for every row (`p` `probs` `[R, N, V]`, argmax `best` `[R, N]`,
    uniforms `uv`; None: every row greedy): the last accepted node `[R]`, the path `[R, N]` and
    the bonus token there `[R]`, drawn from that node's residual alone (the other nodes' are
    never used). `greedy` `[R]` bool: the greedy rows among sampled ones. A plain step (every
    tree the root alone) only draws the bonus."""
    rows, n = tb.shape
    if uv is None and n == 1:
        return best.new_zeros(rows), tb.root_path, best[:, 0]
    if uv is None:
        last, on_path = accepted_path(tb, greedy_choice(tb, best))
        return last, on_path, best.gather(1, last[:, None])[:, 0]
    u, v = uv
    if n == 1:
        last, on_path, residual = best.new_zeros(rows), tb.root_path, probs[:, 0]
    else:
        matched, px = match_choice(tb, probs, u)
        if greedy is not None:
            matched = greedy_choice(tb, best).where(greedy[:, None], matched)
        last, on_path = accepted_path(tb, matched)
        residual = residual_at(tb, probs, px, last)
    bonus = residual_bonus(residual, v.gather(1, last[:, None])[:, 0])
    if greedy is not None:
        bonus = best.gather(1, last[:, None])[:, 0].where(greedy, bonus)
    return last, on_path, bonus


def verdict(
    tb: TreeBatch,
    logits: torch.Tensor,
    probs: torch.Tensor,
    k: int,
    uv: tuple[torch.Tensor, torch.Tensor] | None,
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the host reads of a step, `[R, 2 + N + 2 N k]` float64 (one copy back): per row the
    last accepted node and the bonus token (`accept_all`), the path's flags, and the top-`k`
    ids, then probabilities, of `probs` at every node (what the drafters learn from)."""
    top = torch.topk(probs, k, dim=-1)
    last, on_path, bonus = accept_all(tb, probs, logits.argmax(-1), uv, greedy)
    return torch.cat(
        [
            torch.stack([last, bonus], 1).to(torch.float64),
            on_path.to(torch.float64),
            top.indices.flatten(1).to(torch.float64),
            top.values.flatten(1),
        ],
        dim=1,
    )


def step_verdict(
    cfg: SamplingParams,
    k: int,
    logits: torch.Tensor,
    ints: torch.Tensor,
    masks: torch.Tensor,
    uvw: torch.Tensor | None = None,
) -> torch.Tensor:
    """`verdict` of a batch whose rows share `cfg`, from the step's device tensors alone:
    logits `[R, N, V]`, the trees as `tree_arrays` lays them out, and the uniforms' block
    `[R, 3N]` (`streams.node_uniform_block`; None under greedy). Static shapes and no host
    synchronisation: what `graphs.GraphedAcceptance` captures."""
    tb = TreeBatch.views(ints, masks)
    uv = None
    if uvw is not None:
        u, v, _ = uvw.split(tb.shape[1], 1)
        uv = (u, v)
    return verdict(tb, logits, store_probs(logits, cfg), k, uv)


# The array groups the compiled walk and layout take (`engine.walk_compiled`). A kernel called
# from Python takes each as a plain tuple in its `NamedTuple`'s field order, built as a tuple:
# numba types a named tuple field by field, and converting one costs ~0.3 us a call.


class Children(NamedTuple):
    """The children of M nodes by rank (`SparseLayout.kids`; `walk_compiled.walk_rows` takes it
    as a plain tuple, in this order): `node` `[M, J]` int64 each child's node index in its tree
    (-1 past the last), `slot` `[M, J]` int64 its token's slot in the parent's support, `drawn`
    `[M, J]` bool whether it was drawn (rule (c)) or is deterministic (rule (b)), and `q`
    `[M, K]` float64 each node's q on its support (0 outside q)."""

    node: np.ndarray
    slot: np.ndarray
    drawn: np.ndarray
    q: np.ndarray


class WalkOut(NamedTuple):
    """What `walk_compiled.walk_rows` writes for W walked rows (a plain tuple, in this order):
    `path` `[W, N]` int64 each row's accepted nodes, of which `plen` `[W]` int64 are real, and
    `bonus` `[W]` int64 the token drawn where its walk stopped."""

    path: np.ndarray
    plen: np.ndarray
    bonus: np.ndarray


class TreeRows(NamedTuple):
    """W trees as a compiled drafter's arrays hold them (`tree.DrawnBatch`'s, or gathered for
    `walk_compiled.layout_rows`; `walk_compiled.gather_rows` takes two as plain tuples, in this
    order): `parent` `[W, N]` int64 each node's parent (-1: the root, or past the tree),
    `slot` `[W, N]` int64 its place in its parent's support, `drawn` `[W, N]` bool whether it
    was drawn (`[W, 0]`: every child was), `q_len` `[W, N]` int64 its support's length (-1:
    none), `q_ids` `[W, N, K]` int64 the support's ids (then zeros) and `q_probs` `[W, N, K]`
    float64 its q there (zeros: deterministic children)."""

    parent: np.ndarray
    slot: np.ndarray
    drawn: np.ndarray
    q_len: np.ndarray
    q_ids: np.ndarray
    q_probs: np.ndarray


_EVERY_CHILD_DRAWN = np.zeros((0, 0), np.bool_)  # a `DrawnBatch` without `sampled`, to numba


@dataclass(frozen=True)
class SparseLayout:
    """What rule (c) needs of the walked rows' trees, laid out in one pass per step: every
    node's support (`verify.node_support`: its q's ids, then its children's other tokens) as ids
    `[W, N, K]` (pads repeat its last id; an empty support reads id 0), its length, and for
    the M nodes with children, their children rank by rank (`Children`)."""

    trees: Sequence[DraftTree]
    n: int
    ids: np.ndarray  # [W, N, K] int64
    lens: np.ndarray  # [W * N] int64
    parents: np.ndarray  # [M]: b * N + node of each node with children
    kids: Children

    @staticmethod
    def of(trees: Sequence[DraftTree], n: int, bucket: bool = False) -> SparseLayout:
        """The layout of `trees` padded to `n` nodes; with `bucket`, supports padded to a power
        of two (a captured acceptance's static width)."""
        if trees and all(t.arrays is not None for t in trees):
            return SparseLayout._of_arrays(trees, n, bucket)
        ranks = max((len(c) for t in trees for c in t.children), default=0)
        flat: list[int] = []  # every non-empty support, concatenated
        at: list[int] = []  # b * N + node of each
        lens: list[int] = []
        parents, kid_at, kid_slot, kid_node, kid_drawn = [], [], [], [], []
        q_rows: list[int] = []  # the m of each node with children and a q
        q_lens: list[int] = []
        q_flat: list[float] = []  # their q's probs, concatenated (on slots 0, 1, ...)
        for b, tree in enumerate(trees):
            for node, kids in enumerate(tree.children):
                q = tree.q[node]
                if not kids and q is None:
                    continue  # an empty support
                sup, slots = _support(tree, node)
                if kids:
                    m = len(parents)
                    parents.append(b * n + node)
                    kid_at.extend(range(m * ranks, m * ranks + len(kids)))
                    kid_slot.extend(slots)
                    kid_node.extend(kids)
                    kid_drawn.extend(tree.sampled[c] for c in kids)
                    if q is not None:
                        q_rows.append(m)
                        q_lens.append(len(q.probs))
                        q_flat.extend(q.probs)
                flat.extend(sup)
                at.append(b * n + node)
                lens.append(len(sup))
        k = max(lens, default=1)
        if bucket:
            k = 1 << (k - 1).bit_length()
        sizes = np.asarray(lens, dtype=np.int64)
        ids = np.zeros((len(trees) * n, k), dtype=np.int64)
        ids[at] = _padded(np.asarray(flat, dtype=np.int64), sizes, k)
        size = np.zeros(len(trees) * n, dtype=np.int64)
        size[at] = sizes
        q = np.zeros((len(parents), k))
        if q_rows:
            q[q_rows] = _padded(np.asarray(q_flat), np.asarray(q_lens), k, fill=0.0)

        def grid(vals: list, dtype: type, fill: int = 0) -> np.ndarray:
            out = np.full(len(parents) * ranks, fill, dtype=dtype)
            out[kid_at] = vals
            return out.reshape(len(parents), ranks)

        kids = Children(
            grid(kid_node, np.int64, -1), grid(kid_slot, np.int64), grid(kid_drawn, bool), q
        )
        return SparseLayout(
            trees, n, ids.reshape(len(trees), n, k), size, np.asarray(parents, np.int64), kids
        )

    @staticmethod
    def _of_arrays(trees: Sequence[DraftTree], n: int, bucket: bool) -> SparseLayout:
        """`of` for trees that carry their compiled drafter's arrays (`tree.DrawnArrays`), which
        hold every node's support (its q's ids, or its deterministic children's tokens) and
        each child's place in it: the same layout, compiled (numba is there: it drafted them),
        the trees' rows gathered by one call per batch they were drafted in
        (`walk_compiled.gather_rows`) and laid out by one (`walk_compiled.layout_rows`)."""
        w = len(trees)
        batches: dict[int, tuple[DrawnBatch, list[int], list[int]]] = {}  # id -> (., b, row)
        for b, a in enumerate([t.arrays for t in trees]):
            assert a is not None
            found = batches.get(id(a.batch))
            if found is None:
                found = batches[id(a.batch)] = (a.batch, [], [])
            found[1].append(b)
            found[2].append(a.row)
        width = max(batch.q_ids.shape[2] for batch, _, _ in batches.values())
        into = (  # `TreeRows`, as a plain tuple
            np.full((w, n), -1, np.int64),  # parent
            np.zeros((w, n), np.int64),  # slot
            np.ones((w, n), bool),  # drawn
            np.full((w, n), -1, np.int64),  # q_len
            np.zeros((w, n, width), np.int64),  # q_ids: a node without q reads 0
            np.zeros((w, n, width)),  # q_probs
        )
        # numba loads with the first step that needs it, not with the engine
        from tts_service.engine.walk_compiled import gather_rows, layout_rows

        for batch, at, rows in batches.values():
            sampled = batch.sampled if batch.sampled is not None else _EVERY_CHILD_DRAWN
            drawn = (batch.parents, batch.slot, sampled, batch.q_len, batch.q_ids, batch.q_probs)
            gather_rows(drawn, np.array(rows, np.int64), np.array(at, np.int64), into)
        ids, lens, parents, kid_node, kid_slot, kid_drawn, q = layout_rows(*into, bucket)
        return SparseLayout(
            trees, n, ids, lens, parents, Children(kid_node, kid_slot, kid_drawn, q)
        )

    def supports(self, walked: Sequence[int], rows: int) -> np.ndarray:
        """`[rows, N, K + 1]` int64: at the batch rows `walked` (the layout's trees, in order)
        each node's support ids then 1 where it is empty; every other row empty
        (`step_verdict_walked`'s `supports`)."""
        k = self.ids.shape[-1]
        out = np.zeros((rows, self.n, k + 1), dtype=np.int64)
        out[..., k] = 1
        out[walked, :, :k] = self.ids
        out[walked, :, k] = (self.lens == 0).reshape(len(walked), self.n)
        return out

    def support(self, b: int, node: int) -> list[int]:
        return self.ids[b, node, : self.lens[b * self.n + node]].tolist()


def _support(tree: DraftTree, node: int) -> tuple[list[int], list[int]]:
    """`verify.node_support` of a node (its q's ids, then its children's other tokens) and
    each child's slot in it."""
    q = tree.q[node]
    sup = list(q.ids) if q is not None else []
    kids = tree.children[node]
    if not kids:
        return sup, []
    slot = dict(zip(sup, range(len(sup)), strict=True))
    assert len(slot) == len(sup), "a q's ids are distinct"
    slots = []
    for c in kids:
        x = tree.tokens[c]
        if x not in slot:
            slot[x] = len(sup)
            sup.append(x)
        slots.append(slot[x])
    return sup, slots


def gather_sparse(
    p: torch.Tensor, layout: SparseLayout, u: torch.Tensor, v: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """`gather_support` of the walked rows (`p` `[W, N, V]` and the uniforms `[W, N]` theirs)
    on their supports (`layout.ids`)."""
    sup = torch.from_numpy(layout.ids).to(p.device, non_blocking=True)
    empty = torch.from_numpy(layout.lens == 0).view(sup.shape[:2]).to(p.device)
    return gather_support(p, sup, empty, u, v, w)


def gather_support(
    p: torch.Tensor,
    support: torch.Tensor,
    empty: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
) -> torch.Tensor:
    """What the host walk of rule (c) reads, gathered on the device for the copy back:
    `[R, N, K + 4]`, per node p on its support (`support` `[R, N, K]` ids, `empty` `[R, N]`),
    p's mass outside it, a token drawn from p outside it at the uniform `v`
    (`outside_support`), and the node's host uniforms `u` (acceptance) and `w` (bonus)."""
    on, mass, draw = outside_support(p, support, empty, v)
    parts = [on, mass[..., None], draw[..., None].to(torch.float64), u[..., None], w[..., None]]
    return torch.cat(parts, dim=-1)


def step_verdict_walked(
    cfg: SamplingParams,
    k: int,
    logits: torch.Tensor,
    ints: torch.Tensor,
    masks: torch.Tensor,
    uvw: torch.Tensor,
    supports: torch.Tensor,
) -> torch.Tensor:
    """`step_verdict` of a sampled batch with rows that rule (c) walks on the host, and what
    that walk reads (`gather_support`) at every row's nodes, flattened into one tensor for the
    one copy back. `supports` `[R, N, K + 1]`: each node's support ids (`SparseLayout.ids`),
    then 1 where it is empty (every node of a row not walked). What `graphs.GraphedAcceptance`
    captures for such steps."""
    tb = TreeBatch.views(ints, masks)
    u, v, w = uvw.split(tb.shape[1], 1)
    p = store_probs(logits, cfg)
    main = verdict(tb, logits, p, k, (u, v))
    rule_c = gather_support(p, supports[..., :-1], supports[..., -1].bool(), u, v, w)
    return torch.cat([main.flatten(), rule_c.flatten()])


def _padded(flat: np.ndarray, sizes: np.ndarray, k: int, fill: float | None = None) -> np.ndarray:
    """Rows of `sizes` elements, concatenated in `flat`, as `[len(sizes), k]`: pads repeat the
    row's last element, or hold `fill`."""
    if not flat.size:
        return np.zeros((len(sizes), k), dtype=flat.dtype)
    cols = np.arange(k)
    idx = (np.cumsum(sizes) - sizes)[:, None] + np.minimum(cols, np.maximum(sizes - 1, 0)[:, None])
    out = flat[np.minimum(idx, flat.size - 1)]
    return out if fill is None else np.where(cols < sizes[:, None], out, fill)


def walk_sparse_all(layout: SparseLayout, data: np.ndarray) -> list[Acceptance]:
    """`verify.walk_sparse` for many trees at once (rules (b)-(d), sampled children included):
    the host half of rule (c) on a GPU, from the step's one copy. `data` `[W, N, K + 4]` (on
    the host) holds per node p on its support (`layout.ids`), p's mass outside it, a token
    drawn from p outside it, and the node's uniforms u (accepting it as a child) and w (its
    bonus), as `gather_sparse` gathers them. Compiled (`engine.walk_compiled`): the reference's
    arithmetic in one call for every row."""
    from tts_service.engine.walk_compiled import walk_rows  # numba: with the first walk

    rows, n, _ = data.shape
    kids, m = layout.kids, len(layout.parents)
    m_of = np.full(rows * n, -1, np.int64)
    m_of[layout.parents] = np.arange(m)
    path = np.zeros((rows, n), np.int64)
    plen, bonus = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    c = np.ascontiguousarray  # the layouts the kernel was compiled for (`walk_compiled.warm`)
    walk_rows(
        c(data, np.float64), c(layout.lens, np.int64), c(layout.ids, np.int64), m_of,
        (c(kids.node, np.int64), c(kids.slot, np.int64), c(kids.drawn, np.bool_),
         c(kids.q, np.float64)),  # `Children`, as a plain tuple
        (path, plen, bonus),  # `WalkOut`, as a plain tuple
    )  # fmt: skip
    result = []
    steps_of, bonuses = plen.tolist(), bonus.tolist()
    for b, (tree, steps, x) in enumerate(zip(layout.trees, steps_of, bonuses, strict=True)):
        nodes = tuple(path[b, :steps].tolist())
        result.append(Acceptance(nodes, tuple(tree.tokens[v] for v in nodes), x))
    return result
