"""Every row's draft tree as padded tensors: what a verify step's attention mask and the
batched acceptance (`engine.treebatch`) read.

`TreeBatch.of` lays the trees out on the host (`tree_arrays`: tokens, parents, depths, the
parents' flat indices and positions `[R, N]`, one host-to-device copy) with the ancestor and
earlier-sibling masks `[R, N, N]` (another; unpacked from each tree shape's cached bit rows,
`shape_rows`). A captured acceptance fills the same layout into its static inputs
(`graphs.StepInputs`) and views it with `TreeBatch.views`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import torch

from tts_service.engine.tree import DraftTree


@lru_cache(maxsize=8192)
def shape_rows(parents: tuple[int, ...], nbytes: int) -> tuple[bytes, bytes]:
    """A tree shape's two masks as bit rows, `nbytes` little-endian bytes per node: row i of the
    first has bit j set iff j is i or an ancestor of i; of the second, iff j is a draft node
    with i's parent, listed before i. Python ints as bit sets: one OR per node, so a shape not
    seen before costs about as little as one seen (best-first drafters rarely repeat one)."""
    n = len(parents)
    anc, before, kids = [1] * n, [0] * n, [0] * n  # kids[p]: p's children so far
    for i in range(1, n):
        p = parents[i]
        anc[i] = anc[p] | 1 << i
        before[i] = kids[p]
        kids[p] |= 1 << i
    return _bit_rows(anc, nbytes), _bit_rows(before, nbytes)


@lru_cache(maxsize=1024)
def pad_rows(n: int, width: int) -> tuple[bytes, bytes]:
    """The bit rows (`shape_rows`) of pad nodes n..width-1: each sees only itself."""
    nbytes = (width + 7) // 8
    return _bit_rows([1 << i for i in range(n, width)], nbytes), bytes((width - n) * nbytes)


def _bit_rows(sets: list[int], nbytes: int) -> bytes:
    """Bit sets as rows of `nbytes` little-endian bytes each (what `batch_masks` unpacks)."""
    return b"".join(x.to_bytes(nbytes, "little") for x in sets)


def batch_masks(trees: Sequence[DraftTree], width: int) -> np.ndarray:
    """`[2, R, width, width]` bool: every tree's ancestor and earlier-sibling masks (pads see
    only themselves), unpacked from the rows' bits in one numpy call."""
    nbytes = (width + 7) // 8
    anc: list[bytes] = []
    before: list[bytes] = []
    for t in trees:
        a, b = shape_rows(t.parents, nbytes)
        pa, pb = pad_rows(t.size, width)
        anc += (a, pa)
        before += (b, pb)
    raw = np.frombuffer(b"".join(anc + before), dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little").view(bool)
    return np.ascontiguousarray(bits.reshape(2, len(trees), width, nbytes * 8)[..., :width])


TREE_BLOCKS = 5
"""`tree_arrays`' int blocks of `width` columns: tokens, parents, depths, parents' flat indices,
positions."""


def tree_arrays(
    trees: Sequence[DraftTree], width: int, roots: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """On the host, the trees padded to `width` nodes: `[R, TREE_BLOCKS * width]` int64 (tokens,
    the pads the root's; parents, -1 for the root and pads; depths; the parents' flat indices
    into `[R * width]`, the root and pads their row's node 0; positions, each row's root
    position `roots[b]` (default 0) plus the depth) and the `[2, R, width, width]` masks
    (`batch_masks`): what `TreeBatch.of` copies to the device, two copies a step."""
    pad = [(width - t.size) for t in trees]
    host = np.array(
        [
            (
                *t.tokens,
                *(t.tokens[0],) * p,
                *t.parents,
                *(-1,) * p,
                *t.depths,
                *(0,) * p,
            )
            for t, p in zip(trees, pad, strict=True)
        ],
        dtype=np.int64,
    ).reshape(len(trees), 3 * width)
    rows = np.arange(len(trees), dtype=np.int64)[:, None] * width
    at = rows + np.maximum(host[:, width : 2 * width], 0)
    pos = host[:, 2 * width :]
    if roots is not None:
        pos = pos + np.asarray(roots, dtype=np.int64)[:, None]
    return np.concatenate([host, at, pos], axis=1), batch_masks(trees, width)


@dataclass(frozen=True)
class TreeBatch:
    """Every row's tree padded to `N` nodes; pad nodes are roots of their own that no real
    node sees. `tokens` pads with the row's root token."""

    tokens: torch.Tensor  # [R, N] long
    parents: torch.Tensor  # [R, N] long: -1 for the root and for pads
    ancestors: torch.Tensor  # [R, N, N] bool: (i, j) iff j is i or an ancestor of i
    depths: torch.Tensor  # [R, N] long
    positions: torch.Tensor  # [R, N] long: the root's position plus the depth
    earlier: torch.Tensor | None  # `siblings_before` (None: every tree is its root alone)
    indices: torch.Tensor | None  # `parent_at`, copied with the trees (None: likewise)

    @staticmethod
    def of(
        trees: Sequence[DraftTree],
        width: int,
        device: torch.device,
        roots: Sequence[int] | None = None,
    ) -> TreeBatch:
        """The trees padded to `width` nodes (at least the largest tree's size), their roots at
        positions `roots` (default 0). (A captured acceptance's static inputs are filled by
        `graphs.StepInputs.fill`, with the same layout.)"""
        if width == 1:  # a plain step: every tree is its root
            at = [0] * len(trees) if roots is None else roots
            host = [(t.tokens[0], r) for t, r in zip(trees, at, strict=True)]
            tok, pos = torch.tensor(host, dtype=torch.long).to(device).split(1, 1)
            ones = torch.ones(len(trees), 1, 1, dtype=torch.bool, device=device)
            par, zero = torch.full_like(tok, -1), torch.zeros_like(tok)
            return TreeBatch(tok, par, ones, zero, pos, None, None)
        ints, masks = tree_arrays(trees, width, roots)
        ints_t = torch.from_numpy(ints).to(device, non_blocking=True)
        masks_t = torch.from_numpy(masks).to(device, non_blocking=True)
        return TreeBatch.views(ints_t, masks_t)

    @staticmethod
    def views(ints: torch.Tensor, masks: torch.Tensor) -> TreeBatch:
        """The batch over `tree_arrays`' layout on the device (views only): a captured
        acceptance rebuilds it from its static inputs."""
        tok, par, depths, at, pos = ints.split(masks.shape[-1], 1)
        anc, before = masks
        return TreeBatch(tok, par, anc, depths, pos, before, at)

    def head(self, rows: int) -> TreeBatch:
        """The first `rows` rows (a bucket's real rows; views)."""
        parts = (self.tokens, self.parents, self.ancestors, self.depths, self.positions)
        earlier = None if self.earlier is None else self.earlier[:rows]
        indices = None if self.indices is None else self.indices[:rows]
        return TreeBatch(*(x[:rows] for x in parts), earlier, indices)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.tokens.shape[0], self.tokens.shape[1])

    @cached_property
    def siblings_before(self) -> torch.Tensor:
        """`[R, N, N]` bool: (i, j) iff j is a draft node with i's parent, listed before i."""
        if self.earlier is not None:
            return self.earlier
        return torch.zeros(self.ancestors.shape, dtype=torch.bool, device=self.tokens.device)

    @cached_property
    def real(self) -> torch.Tensor:
        """`[R, N]` bool: the nodes of each row's tree (its root and draft nodes, not pads)."""
        real = self.parents >= 0
        real[:, 0] = True
        return real

    @property
    def root_path(self) -> torch.Tensor:
        """`[R, N]` bool: the path of a step that accepts no draft node, the root alone (the
        root's row of the ancestor mask)."""
        return self.ancestors[:, 0]

    @cached_property
    def draft(self) -> torch.Tensor:
        """`[R, N]` bool: the draft nodes (real nodes but the root)."""
        return self.parents >= 0

    @cached_property
    def firsts(self) -> torch.Tensor:
        """`[R, N]` bool: draft nodes whose token no earlier sibling has (a duplicate is never
        accepted: its mass was rejected with the first)."""
        same_token = self.tokens[:, :, None] == self.tokens[:, None, :]
        return self.draft & ~(self.siblings_before & same_token).any(-1)

    @cached_property
    def parent_at(self) -> torch.Tensor:
        """`[R, N]` long: each node's parent as an index into the flattened `[R * N]` nodes
        (the root and pads: their own row's node 0); computed with the trees on the host."""
        if self.indices is not None:
            return self.indices
        rows, n = self.shape
        at = torch.arange(rows, device=self.tokens.device)[:, None] * n
        return at + self.parents.clamp(min=0)

    def at_parent(self, values: torch.Tensor) -> torch.Tensor:
        """`values[b, parents[b, i]]` (`[R, N]`; the root and pads read node 0)."""
        return values.take(self.parent_at)
