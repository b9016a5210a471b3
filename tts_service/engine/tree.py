"""Draft trees as data, and packing a tree into one verify forward (SpecInfer-style tree attention).

Conventions: node 0 is the **root**, the last committed token, whose KV is
not cached yet; every other node holds one draft token. Nodes are topologically ordered
(`parents[i] < i`; drafters emit BFS order). Siblings are verified in list order, which for
stochastic children is their sampling order. `q` is the sparse draft distribution a node's
*sampled* children were drawn from (a snapshot taken at drafting time); deterministic children
have no `q`. See docs/design.md, "Draft trees and the attention mask".
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch where tensors are made: the CLI's parser imports this module
    import torch


@dataclass(frozen=True)
class SparseDist:
    """A draft distribution over a few token ids; `probs` are renormalised on use."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        assert len(self.ids) == len(self.probs), "ids and probs must align"


class DrawnQ(Sequence[SparseDist | None]):
    """A compiled drafter's tree's `q`, read from its kernel's `[R, M]` / `[R, M, K]` arrays
    when a node is asked for: a `SparseDist` of the first `q_len` ids where `at` is set, else
    None. Rule (c)'s layout reads the arrays themselves (`DrawnArrays`), and a walk reads only
    the nodes it reaches, so most snapshots are never made (building all of them cost a
    16-row step ~0.1 ms). Indexed by node (negative from the end, as a tuple); equal to the
    tuple of its nodes' q."""

    __slots__ = ("at", "q_len", "q_ids", "q_probs", "row", "n")

    def __init__(
        self,
        at: np.ndarray,
        q_len: np.ndarray,
        q_ids: np.ndarray,
        q_probs: np.ndarray,
        row: int,
        n: int,
    ) -> None:
        self.at, self.q_len, self.q_ids, self.q_probs = at, q_len, q_ids, q_probs
        self.row, self.n = row, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, node: int) -> SparseDist | None:  # type: ignore[override]
        if node < 0:
            node += self.n
        if not 0 <= node < self.n:
            raise IndexError(node)
        r = self.row
        if not self.at[r, node]:
            return None
        k = int(self.q_len[r, node])
        return SparseDist(
            tuple(self.q_ids[r, node, :k].tolist()), tuple(self.q_probs[r, node, :k].tolist())
        )

    def __iter__(self) -> Iterator[SparseDist | None]:
        return (self[i] for i in range(self.n))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple | DrawnQ):
            return NotImplemented
        return len(other) == self.n and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


@dataclass(frozen=True)
class DrawnBatch:
    """The arrays a compiled drafter drew one step's trees in, `[R, M]` or `[R, M, K]` for its
    R rows and M node slots (past a tree's nodes: parent -1, no q). A node's support is its q's
    ids where its children are drawn, else its (deterministic) children's tokens in order."""

    parents: np.ndarray  # int64
    slot: np.ndarray  # int64: each node's place in its parent's support (the root's: -1)
    q_len: np.ndarray  # int64: how many ids the node's support has (-1: none)
    q_ids: np.ndarray  # int64: its support's ids, then zeros
    q_probs: np.ndarray  # float64: its q's probabilities (zeros: deterministic children)
    sampled: np.ndarray | None = None  # bool: the node was drawn (None: every child was)


@dataclass(frozen=True)
class DrawnArrays:
    """A tree whose children were drawn from their parent's `q` by a compiled drafter (some of
    them, where the batch says which): row `row` of the batch it was drafted in. What
    `treebatch.SparseLayout.of` lays out compiled, one call per batch and one for the step
    (`walk_compiled.gather_rows`, `layout_rows`), instead of a loop over every tree's nodes."""

    batch: DrawnBatch
    row: int


@dataclass(frozen=True)
class DraftTree:
    """A draft token tree. All lists are `[n]`, node 0 is the root."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # parents[0] == -1
    sampled: tuple[bool, ...]  # node i was drawn from q[parents[i]] (else deterministic)
    # per node: what its sampled children were drawn from (a compiled drafter's: `DrawnQ`)
    q: Sequence[SparseDist | None]
    # the same, as a compiled drafter's arrays (None: laid out from the fields above)
    arrays: DrawnArrays | None = field(default=None, compare=False, repr=False)
    depths: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        n, parents = len(self.tokens), self.parents
        assert len(parents) == len(self.sampled) == len(self.q) == n and n >= 1
        assert parents[0] == -1, "node 0 is the root"
        depths = [0] * n
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):  # one pass: check the order, count depths, list children
            p = parents[i]
            assert 0 <= p < i, "parents come before their children"
            depths[i] = depths[p] + 1
            kids[p].append(i)
        object.__setattr__(self, "depths", tuple(depths))
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def path_tokens(self, node: int) -> list[int]:
        """Draft tokens from the root's first child down to `node` (root excluded)."""
        out: list[int] = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    @staticmethod
    def root_only(root: int) -> DraftTree:
        return DraftTree((root,), (-1,), (False,), (None,))

    @staticmethod
    def chain(root: int, draft: list[int]) -> DraftTree:
        """A linear chain of deterministic drafts (PLD)."""
        n = len(draft) + 1
        return DraftTree((root, *draft), tuple(range(-1, n - 1)), (False,) * n, (None,) * n)


class TreeBuilder:
    """Grow a tree node by node; drafters use it so trees are always well formed."""

    def __init__(self, root: int) -> None:
        self.tokens = [root]
        self.parents = [-1]
        self.sampled = [False]
        self.q: list[SparseDist | None] = [None]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, sampled: bool = False) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.sampled.append(sampled)
        self.q.append(None)
        return len(self.tokens) - 1

    def set_q(self, node: int, q: SparseDist) -> None:
        self.q[node] = q

    def build(self) -> DraftTree:
        return DraftTree(
            tuple(self.tokens), tuple(self.parents), tuple(self.sampled), tuple(self.q)
        )


def ancestor_mask(parents: tuple[int, ...] | list[int]) -> torch.Tensor:
    """`[n, n]` bool: entry (i, j) is True iff j is i or an ancestor of i."""
    import torch

    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def pack(
    tree: DraftTree, prefix_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the verify forward for one sequence whose cache holds `prefix_len` tokens.

    Returns:
        input_ids `[1, n]`, position_ids `[1, n]` (prefix_len + depth), and the additive 4-D
        mask `[1, 1, n, prefix_len + n]` in `dtype` (0 = attend, finfo.min = blocked; a bool
        mask is silently wrong with eager attention, see
        docs/design.md, "Draft trees and the attention mask").
    """
    import torch

    n = tree.size
    allowed = torch.cat(
        [torch.ones(n, prefix_len, dtype=torch.bool), ancestor_mask(tree.parents)], dim=1
    )
    mask = torch.zeros(n, prefix_len + n, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    ids = torch.tensor([tree.tokens], dtype=torch.long, device=device)
    pos = torch.tensor([tree.depths], dtype=torch.long, device=device) + prefix_len
    return ids, pos, mask[None, None].to(device)


@dataclass(frozen=True)
class TreeShape:
    """A static tree template: parent indices (node 0 = root) and each node's rank among its
    siblings (rank i = the parent's i-th candidate)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)  # per node, in id order

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a tree shape starts with the root, whose parent is -1")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError("tree shape parents must precede their children")
        kids: list[list[int]] = [[] for _ in self.parents]
        ranks = [0]
        for i, p in enumerate(self.parents[1:], start=1):
            ranks.append(len(kids[p]))
            kids[p].append(i)
        object.__setattr__(self, "ranks", tuple(ranks))
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))

    @property
    def num_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.parents) - 1


def load_tree_shape(path: Path) -> TreeShape:
    """Load a tree shape: a JSON file with a `parents` list (names are resolved by the config,
    `config.drafters.resolve_tree_path`).

    Raises:
        ValueError: malformed parents.
    """
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("parents"), list):
        raise ValueError(f"{path}: expected an object with a 'parents' list")
    return TreeShape(tuple(int(p) for p in data["parents"]))


def select_subtree(shape: TreeShape, counts: Sequence[float], k: int) -> list[int]:
    """The best `k` shape nodes by count (or any score), closed under parents and earlier
    siblings: with in-order verification such a subtree is a tree whose nodes keep their
    meaning (a node's rank among its siblings is unchanged).

    Returns shape node ids in selection order (root first); ties go to the lower id.
    """
    children = shape.children
    chosen = [0]
    frontier: list[tuple[float, int]] = []  # (-count, node): each parent's next untaken child
    if children[0]:
        heapq.heappush(frontier, (-counts[children[0][0]], children[0][0]))
    while frontier and len(chosen) < k + 1:
        _, node = heapq.heappop(frontier)
        chosen.append(node)
        parent = shape.parents[node]
        siblings = children[parent]
        nxt = siblings.index(node) + 1
        if nxt < len(siblings):
            heapq.heappush(frontier, (-counts[siblings[nxt]], siblings[nxt]))
        if children[node]:
            first = children[node][0]
            heapq.heappush(frontier, (-counts[first], first))
    return chosen
