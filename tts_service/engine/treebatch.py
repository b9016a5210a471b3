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

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tts_service.engine.sampling import SamplingParams, store_probs
from tts_service.engine.tree import DraftTree, DrawnBatch
from tts_service.engine.treepack import TreeBatch
from tts_service.engine.verify import Acceptance, SparseNode

_TINY = 1e-300


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
    threshold = torch.where(left > _TINY, px / left, 0.0)
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


WALK_COMPILED = importlib.util.find_spec("numba") is not None
"""`walk_sparse_all` runs compiled (`engine.walk_compiled`); else in array operations."""

WALK_ALL_FROM = 1 if WALK_COMPILED else 8
"""Rows of rule (c) from which `walk_sparse_all` beats walking them one by one
(`GatheredNodes`: the nodes each walk reaches only). `bench.host`, stand at 8 nodes: compiled
(0.03 ms at 4 walked rows, `bench.walk`), the same verify time at 1 row and less at 4; in array
operations (a fixed ~0.25–0.5 ms a step) slower at 1 and 4 rows, faster at 16 and 64."""


class GatheredNodes:
    """Row `b`'s `verify.SparseNode`s read from `gather_sparse`'s copy when a walk
    reaches them (`verify.walk_sparse`), and its uniforms (u, w)."""

    def __init__(self, layout: SparseLayout, data: np.ndarray, b: int) -> None:
        self.layout, self.rows, self.b = layout, data[b], b
        k = data.shape[-1] - 4
        self.k = k
        self.u, self.w = self.rows[:, k + 2].tolist(), self.rows[:, k + 3].tolist()

    def __getitem__(self, node: int) -> SparseNode:
        support, row, k = self.layout.support(self.b, node), self.rows[node], self.k
        return SparseNode(support, row[: len(support)].tolist(), float(row[k]), int(row[k + 1]))


@dataclass(frozen=True)
class _Children:
    """The children of M nodes by rank `[M, J]` (node index in its tree, -1 past the last;
    slot in the parent's support; drawn or not) and each node's q on its support `[M, K]`."""

    node: np.ndarray
    slot: np.ndarray
    drawn: np.ndarray
    q: np.ndarray


_EVERY_CHILD_DRAWN = np.zeros((0, 0), np.bool_)  # a `DrawnBatch` without `sampled`, to numba


@dataclass(frozen=True)
class SparseLayout:
    """What rule (c) needs of the walked rows' trees, laid out in one pass per step: every
    node's support (`verify.node_support`: its q's ids, then its children's other tokens) as ids
    `[W, N, K]` (pads repeat its last id; an empty support reads id 0), its length, and for
    the M nodes with children, their children rank by rank (`_Children`)."""

    trees: Sequence[DraftTree]
    n: int
    ids: np.ndarray  # [W, N, K] int64
    lens: np.ndarray  # [W * N] int64
    parents: np.ndarray  # [M]: b * N + node of each node with children
    kids: _Children

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

        kids = _Children(
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
        parent = np.full((w, n), -1, np.int64)
        slot = np.zeros((w, n), np.int64)
        q_len = np.full((w, n), -1, np.int64)
        q_ids = np.zeros((w, n, width), np.int64)  # a node without q: zeros (its ids read 0)
        q_probs = np.zeros((w, n, width))
        drawn = np.ones((w, n), bool)
        # a compiled drafter's trees: numba is there
        from tts_service.engine.walk_compiled import gather_rows, layout_rows

        for batch, at, rows in batches.values():
            sampled = batch.sampled if batch.sampled is not None else _EVERY_CHILD_DRAWN
            gather_rows(
                batch.parents, batch.slot, sampled, batch.q_len, batch.q_ids, batch.q_probs,
                np.array(rows, np.int64), np.array(at, np.int64),
                parent, slot, drawn, q_len, q_ids, q_probs,
            )  # fmt: skip
        ids, lens, parents, kid_node, kid_slot, kid_drawn, q = layout_rows(
            parent, slot, drawn, q_len, q_ids, q_probs, bucket
        )
        return SparseLayout(
            trees, n, ids, lens, parents, _Children(kid_node, kid_slot, kid_drawn, q)
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
    bonus), as `gather_sparse` gathers them.

    Compiled (`engine.walk_compiled`, the reference's arithmetic in one call for every row)
    where numba is importable; else in array operations (`walk_sparse_arrays`)."""
    if not WALK_COMPILED:
        return walk_sparse_arrays(layout, data)
    from tts_service.engine.walk_compiled import walk_rows

    rows, n, _ = data.shape
    kids, m = layout.kids, len(layout.parents)
    m_of = np.full(rows * n, -1, np.int64)
    m_of[layout.parents] = np.arange(m)
    path = np.zeros((rows, n), np.int64)
    plen, bonus = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
    c = np.ascontiguousarray  # the layouts the kernel was compiled for (`walk_compiled.warm`)
    walk_rows(
        c(data, np.float64), c(layout.lens, np.int64), c(layout.ids, np.int64), m_of,
        c(kids.node, np.int64), c(kids.slot, np.int64), c(kids.drawn, np.bool_),
        c(kids.q, np.float64), path, plen, bonus,
    )  # fmt: skip
    out = []
    steps_of, bonuses = plen.tolist(), bonus.tolist()
    for b, (tree, steps, x) in enumerate(zip(layout.trees, steps_of, bonuses, strict=True)):
        nodes = tuple(path[b, :steps].tolist())
        out.append(Acceptance(nodes, tuple(tree.tokens[v] for v in nodes), x))
    return out


def walk_sparse_arrays(layout: SparseLayout, data: np.ndarray) -> list[Acceptance]:
    """`walk_sparse_all` without numba, in a fixed number of array operations per sibling
    rank whatever the row count (numpy: on arrays this small an operation costs a microsecond,
    a torch op several). A node's residual after each of its children is rejected is known
    before the walk (the children are tried in order, each rejection's residual a function of
    the last), so every node with children steps through them at once, rank by rank; a row's
    walk then follows the first child each node accepts and reads the bonus of the node it
    stops at."""
    rows, n, width = data.shape
    k = width - 4
    flat = data.reshape(rows * n, width)
    values = np.where(np.arange(k) < layout.lens[:, None], flat[:, :k], 0.0)  # pads: nothing
    mass, scale = flat[:, k], np.ones(rows * n)  # the outside's share of a residual: scale·mass
    pick = np.full(rows * n, -1)  # the child each node accepts (its rank)
    at = layout.parents
    if len(at):
        accept, values[at], scale[at] = _step_children(values[at], scale[at], mass[at], layout.kids)
        kid_u = np.ones(accept.shape)  # a pad rank is never accepted
        real = layout.kids.node >= 0
        kid_u[real] = flat[((at // n)[:, None] * n + layout.kids.node)[real], k + 2]
        passed = kid_u < accept
        pick[at] = np.where(passed.any(-1), passed.argmax(-1), -1)
    slot = bonus_slot(values, scale * mass, flat[:, k + 3]).tolist()
    outside, pick = flat[:, k + 1].astype(np.int64).tolist(), pick.tolist()
    ids = layout.ids.reshape(rows * n, -1)
    out = []
    for b, tree in enumerate(layout.trees):
        node, path = 0, []
        while pick[b * n + node] >= 0:
            node = tree.children[node][pick[b * n + node]]
            path.append(node)
        s = slot[b * n + node]
        bonus = int(ids[b * n + node, s]) if s >= 0 else outside[b * n + node]
        out.append(Acceptance(tuple(path), tuple(tree.tokens[v] for v in path), bonus))
    return out


def _step_children(
    values: np.ndarray, scale: np.ndarray, mass: np.ndarray, kids: _Children
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each node's children tried in order from its residual (`values` on the support `[M, K]`,
    the outside at `scale` × `mass`): each child's acceptance probability once its earlier
    siblings were rejected `[M, J]`, by its own rule (`verify._child_step`), and the residual
    after all of them."""
    m, k = values.shape
    rows = np.arange(m)
    tried = np.zeros((m, k), dtype=bool)
    accept = np.zeros(kids.slot.shape)
    for j in range(kids.slot.shape[1]):
        on, x = kids.node[:, j] >= 0, kids.slot[:, j]
        total = values.sum(-1) + scale * mass
        norm = np.where(on & (total > _TINY), total, 1.0)
        values, scale = values / norm[:, None], scale / norm
        vx = values[rows, x]
        qi = np.where(tried, 0.0, kids.q)
        qs = qi.sum(-1)
        qi = qi / np.where(qs > 0, qs, 1.0)[:, None]
        qx = qi[rows, x]
        rrs = np.where(qx > 0, np.minimum(vx / np.where(qx > 0, qx, 1.0), 1.0), 0.0)
        rest = np.maximum(values - qi, 0.0)
        same = rest.sum(-1) + scale * mass <= _TINY  # r == q_i: every draft is accepted
        rrs = np.where(same, 1.0, rrs)
        rest = np.where(same[:, None], values, rest)
        matched = values.copy()
        matched[rows, x] = 0.0
        drawn = kids.drawn[:, j]
        accept[:, j] = np.where(on, np.where(drawn, rrs, vx), 0.0)
        rest = np.where(drawn[:, None], rest, matched)
        values = np.where(on[:, None], rest, values)
        tried[rows[on], x[on]] = True
    return accept, values, scale


def bonus_slot(values: np.ndarray, outside_mass: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`verify._draw` for many nodes at once: the support slot `[M]` of the token drawn at the
    uniform `w` from a residual with `values` `[M, K]` on the support and `outside_mass` spread
    as p outside it: the first slot whose cumulative mass exceeds w × the total; -1: the
    outside's token."""
    total = values.sum(-1) + outside_mass
    positive = values > 0
    hit = positive & ((w * total)[:, None] < np.cumsum(values, -1))
    slots = np.arange(values.shape[-1])
    last = np.where(positive, slots, -1).max(-1, initial=-1)  # rounding past the support
    spill = np.where((outside_mass > 0) | (last < 0), -1, last)
    return np.where(hit.any(-1), hit.argmax(-1), spill)
