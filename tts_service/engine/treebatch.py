"""Every row's draft tree as padded tensors, and lossless acceptance for all rows at once.

`engine.verify` walks one tree on the host, node by node; that is the reference. Here the same
rules, (a) greedy and (b) sample-and-match over deterministic drafts, run for the whole batch
on the device in a fixed number of tensor ops (whatever the row count and tree shapes), so a
GPU host launches a few dozen kernels per step and copies one result back:

* `TreeBatch.of`: tokens and parents `[R, N]` from the trees (two host-to-device copies); the
  ancestor masks `[R, N, N]` by pointer jumping (log2 N boolean matmuls), which the attention
  mask, the depths and the acceptance all read.
* `greedy_choice` / `match_choice`: which child each node accepts, if any. Rule (b): a child
  x_i, the first of its token among its siblings, is accepted with probability
  p(x_i) / (p(x_i) + the mass of its later siblings + the node's residual mass), the mass not yet
  rejected summed from what is left, so a child holding all of it is accepted with probability
  exactly 1; the residual bonus is drawn per node up front (its residual is known before the
  walk), as `verify.draw_match` does.
* `accepted_path`: the deepest node whose whole path was chosen, and that path.

The uniforms come from `streams.counter_uniforms`: a function of (the row's seed, the root's
position, the node), so a row's draws do not depend on the batch it is in, and one call serves
every row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tts_service.engine.tree import DraftTree

_TINY = 1e-300


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """`[R, N, N]` bool from `[R, N]` parents (-1: none): (i, j) iff j is i or an ancestor of
    i. Pointer jumping: after k rounds every node reaches 2^k generations up."""
    _, n = parents.shape
    hop = torch.nn.functional.one_hot(parents + 1, n + 1)[..., 1:].to(torch.float32)
    reach = hop + torch.eye(n, dtype=torch.float32, device=parents.device)
    for _ in range(max(n - 1, 1).bit_length()):
        reach = (torch.bmm(reach, reach) > 0).to(torch.float32)
    return reach > 0


@dataclass(frozen=True)
class TreeBatch:
    """Every row's tree padded to `N` nodes; pad nodes are roots of their own that no real
    node sees. `tokens` pads with the row's root token."""

    tokens: torch.Tensor  # [R, N] long
    parents: torch.Tensor  # [R, N] long: -1 for the root and for pads
    real: torch.Tensor  # [R, N] bool: a node of the row's tree
    ancestors: torch.Tensor  # [R, N, N] bool: (i, j) iff j is i or an ancestor of i
    depths: torch.Tensor  # [R, N] long

    @staticmethod
    def of(trees: Sequence[DraftTree], width: int, device: torch.device) -> TreeBatch:
        """The trees padded to `width` nodes (at least the largest tree's size)."""
        if width == 1:  # a plain step: every tree is its root
            tok = torch.tensor([t.tokens[:1] for t in trees], dtype=torch.long).to(device)
            ones = torch.ones(len(trees), 1, 1, dtype=torch.bool, device=device)
            return TreeBatch(tok, torch.full_like(tok, -1), ones[:, 0], ones, torch.zeros_like(tok))
        tokens = [(*t.tokens, *(t.tokens[0],) * (width - t.size)) for t in trees]
        parents = [(*t.parents, *(-1,) * (width - t.size)) for t in trees]
        tok = torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        par = torch.tensor(parents, dtype=torch.long).to(device, non_blocking=True)
        size = torch.tensor([t.size for t in trees], dtype=torch.long).to(device)
        real = torch.arange(width, device=device)[None] < size[:, None]
        anc = ancestor_masks(par)
        return TreeBatch(tok, par, real, anc, anc.sum(-1) - 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.tokens.shape[0], self.tokens.shape[1])

    @cached_property
    def siblings_before(self) -> torch.Tensor:
        """`[R, N, N]` bool: (i, j) iff j is a real draft node with i's parent, listed first."""
        n = self.shape[1]
        earlier = torch.ones(n, n, dtype=torch.bool, device=self.tokens.device).tril(-1)
        draft = self.real & (self.parents >= 0)
        same = self.parents[:, :, None] == self.parents[:, None, :]
        return same & earlier & draft[:, None, :] & draft[:, :, None]

    @cached_property
    def firsts(self) -> torch.Tensor:
        """`[R, N]` bool: real draft nodes whose token no earlier sibling has (a duplicate is
        never accepted: its mass was rejected with the first)."""
        same_token = self.tokens[:, :, None] == self.tokens[:, None, :]
        dup = (self.siblings_before & same_token).any(-1)
        return self.real & (self.parents >= 0) & ~dup

    def at_parent(self, values: torch.Tensor) -> torch.Tensor:
        """`values[b, parents[b, i]]` (`[R, N]`; the root and pads read node 0)."""
        return values.gather(1, self.parents.clamp(min=0))


def greedy_choice(batch: TreeBatch, best: torch.Tensor) -> torch.Tensor:
    """Rule (a): the child holding the argmax `best` (`[R, N]`) of its parent."""
    return batch.firsts & (batch.tokens == batch.at_parent(best))


def match_choice(
    batch: TreeBatch, p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule (b) over deterministic drafts, with `p` `[R, N, V]` float64 and uniforms `u`
    `[R, N]`: (the chosen children `[R, N]` bool, the residual `[R, N, V]` at every node: p
    without its children's tokens)."""
    rows, n = batch.shape
    before, firsts = batch.siblings_before, batch.firsts
    flat = p.flatten(0, 1)
    at = torch.arange(rows, device=p.device)[:, None] * n + batch.parents.clamp(min=0)
    px = torch.where(firsts, flat[at, batch.tokens], 0.0)
    residual = flat.index_put((at, batch.tokens), -px, accumulate=True).view_as(p)
    mass = residual.sum(-1)
    later = before.transpose(1, 2)  # (i, j): j is a later sibling of i
    left = px + (later * px[:, None, :]).sum(-1) + batch.at_parent(mass)
    threshold = torch.where(left > _TINY, px / left, 0.0)
    passed = firsts & (u < threshold)
    chosen = passed & ~(before & passed[:, None, :]).any(-1)
    return chosen, residual


def residual_bonus(residual: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`[R, N]`: a token drawn from every node's residual (`[R, N, V]`, any positive scale) by
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
    unchosen = ~chosen & (batch.parents >= 0)
    blocked = (batch.ancestors & unchosen[:, None, :]).any(-1)
    ok = batch.real & ~blocked
    last = torch.where(ok, batch.depths, -1).argmax(-1)
    on_path = batch.ancestors[torch.arange(batch.shape[0], device=last.device), last]
    return last, on_path
