"""Lossless tree verification: which draft nodes to accept, and the bonus token.

Pure functions: a `DraftTree`, the target `p` (or logits under greedy) at every node, and an
explicit `torch.Generator` go in; an `Acceptance` comes out. No model, no store, no global RNG.
The rules (docs/design.md, "Verification rules"):

* greedy (a): descend to the child holding argmax p; the argmax at the last node is the bonus.
* sample-and-match (b), SpecInfer / Miao et al. 2024: a deterministic child x is accepted with
  probability r(x); on rejection r <- r with x zeroed, renormalised.
* recursive rejection sampling (c), Jeon et al. 2024: a child x drawn without replacement from
  q_i = q with the earlier siblings removed, renormalised, is accepted with min(1, r(x)/q_i(x));
  on rejection r <- norm(max(0, r - q_i)). Using the un-renormalised q (the i.i.d. formula) is
  lossy for two or more children.
* mixed nodes (d): siblings are tried in list order, each with its own rule, sharing the residual.

The bonus token is drawn from the residual at the last accepted node (from p if it had no
children), so every committed token is distributed exactly as under plain sampling.

The engine verifies a whole batch at once: rules (a) and (b) on the device
(`engine.treebatch`), rules (c) and (d) on the host from p on each node's support
(`walk_sparse`). The per-tree walks here (`verify_greedy`/`accept_greedy`,
`draw_match` + `accept_match`, `verify_sampling`) are the references they are tested against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add
from typing import TYPE_CHECKING, Protocol

from tts_service.engine.sampling import sample
from tts_service.engine.tree import DraftTree, SparseDist

if TYPE_CHECKING:  # torch where tensors are made: the CLI's parser imports this module
    import torch

TINY = 1e-300
"""A residual mass at or below this is none (every rule (c) walk reads it from here)."""


@dataclass(frozen=True)
class Acceptance:
    """The result of verifying one tree."""

    path: tuple[int, ...]  # accepted node indices in depth order, root excluded
    tokens: tuple[int, ...]  # their draft tokens
    bonus: int  # token chosen at the last accepted node

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def committed(self) -> tuple[int, ...]:
        """Tokens this step commits: accepted drafts then the bonus."""
        return (*self.tokens, self.bonus)

    def upto(self, k: int) -> Acceptance:
        """The acceptance of the first `k` committed tokens (a row that stopped inside the
        accepted block): its last one becomes the bonus."""
        if k >= len(self.tokens) + 1:
            return self
        return Acceptance(self.path[: k - 1], self.tokens[: k - 1], self.committed[k - 1])


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Rule (a): follow the argmax. `logits`: `[n, V]`, one row per tree node."""
    return accept_greedy(tree, logits.argmax(dim=-1).tolist())


def accept_greedy(tree: DraftTree, best: Sequence[int]) -> Acceptance:
    """Rule (a) on the host, from the argmax at every node (computed on the device)."""
    node, path = 0, []
    while True:
        y = best[node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == y), None)
        if nxt is None:
            return Acceptance(tuple(path), tuple(tree.tokens[c] for c in path), y)
        path.append(nxt)
        node = nxt


def proposal(
    q: SparseDist, excluded: list[int], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """What a sampled child was actually drawn from: `q` without `excluded`, renormalised.

    Returns a dense `[V]` float64 tensor on `device` (all zeros if nothing is left).
    """
    import torch

    dense = torch.zeros(vocab_size, dtype=torch.float64, device=device)
    dense[list(q.ids)] = torch.tensor(q.probs, dtype=torch.float64, device=device)
    if excluded:
        dense[excluded] = 0.0
    total = dense.sum()
    return dense / total if total > 0 else dense


def sample_and_match_step(r: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """Rule (b) for one deterministic draft `x`: (acceptance probability, residual on rejection)."""
    accept = float(r[x])
    rest = r.clone()
    rest[x] = 0.0
    total = rest.sum()
    return accept, (rest / total if total > TINY else rest)


def rrs_step(r: torch.Tensor, q_i: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
    """Rule (c) for one sampled draft `x ~ q_i`: (acceptance probability, residual on rejection)."""
    import torch

    accept = min(1.0, float(r[x] / q_i[x])) if q_i[x] > 0 else 0.0
    rest = torch.clamp(r - q_i, min=0.0)
    total = rest.sum()
    if total <= TINY:  # r == q_i: every draft is accepted, the residual is never used
        return 1.0, r
    return accept, rest / total


def verify_node(
    tree: DraftTree, node: int, p: torch.Tensor, generator: torch.Generator
) -> tuple[int | None, torch.Tensor]:
    """Try `node`'s children in order against the target `p` (`[V]`), with uniforms from
    `generator`, which lives on `p`'s device (as every tensor built here does).

    Returns:
        (the accepted child's node index, None) or (None, the residual to draw the bonus from).
    """
    import torch

    r, tried = p, []
    for child in tree.children[node]:
        x = tree.tokens[child]
        if tree.sampled[child]:
            q = tree.q[node]
            assert q is not None, "a sampled child needs its parent's q snapshot"
            accept, residual = rrs_step(r, proposal(q, tried, p.shape[-1], p.device), x)
        else:
            accept, residual = sample_and_match_step(r, x)
        u = torch.rand((), generator=generator, dtype=torch.float64, device=generator.device)
        if float(u) < accept:
            return child, r
        r = residual
        tried.append(x)
    return None, r


def verify_sampling(tree: DraftTree, p: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Walk the tree under sampling. `p`: `[n, V]` target distributions, one row per node."""
    node, path = 0, []
    while True:
        child, residual = verify_node(tree, node, p[node], generator)
        if child is None:
            bonus = sample(residual, generator)
            return Acceptance(tuple(path), tuple(tree.tokens[c] for c in path), bonus)
        path.append(child)
        node = child


def draw_match(tree: DraftTree, p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Device half of rule (b) over a tree of deterministic drafts, with no host sync: what
    `accept_match` needs, as one float64 tensor `[4n - 2]` to copy back at once.

    * `[0, n-1)`: p(x) of every draft node x at its parent;
    * `[n-1, 2n-2)`: one uniform per draft node;
    * `[2n-2, 3n-2)`: per node, a bonus drawn from its residual once all its children are
      rejected (p without its children's tokens, renormalised);
    * `[3n-2, 4n-2)`: per node, that residual's mass (what `accept_match` renormalises by, so
      a child holding all the mass left is accepted with probability exactly 1).

    The residual after rejecting deterministic siblings x_1..x_j is p without them, so each
    child's acceptance probability is p(x) / (1 - Σ p(x_<i)) and each node's final residual is
    known before the walk: drawing every bonus up front is exact (they use their own uniforms).
    """
    import torch

    n, device = tree.size, p.device
    parents = torch.tensor(tree.parents[1:], dtype=torch.long, device=device)
    drafts = torch.tensor(tree.tokens[1:], dtype=torch.long, device=device)
    child_p = p[parents, drafts].to(torch.float64)
    u = torch.rand(n - 1, generator=generator, dtype=torch.float64, device=device)
    residual = p.to(torch.float64).index_put((parents, drafts), torch.zeros_like(child_p))
    cdf = torch.cumsum(residual, dim=-1)
    total = cdf[:, -1:]
    v = torch.rand(n, 1, generator=generator, dtype=torch.float64, device=device)
    # strictly below the total, so the first cdf step above it has positive mass
    x = torch.minimum(v * total, torch.nextafter(total, torch.zeros_like(total)))
    bonus = torch.searchsorted(cdf, x, right=True).clamp_(max=p.shape[-1] - 1)
    return torch.cat([child_p, u, bonus[:, 0].to(torch.float64), total[:, 0]])


def accept_match(tree: DraftTree, drawn: Sequence[float]) -> Acceptance:
    """Host half of rule (b): walk the tree with `draw_match`'s values.

    A child x_i (the first of its token among its siblings) is accepted with probability
    p(x_i) / (1 - Σ p(x_<i)), the mass not yet rejected; that mass is summed from what is left
    (p(x_i), the later siblings' p and the node's residual mass), not subtracted from 1, so a
    child holding all the mass left gets a threshold of exactly 1 even when p sums to 1 - 2^-52
    in floating point, and a bonus is never drawn from an empty residual."""
    n = tree.size
    node, path = 0, []
    while True:
        firsts, seen = [], set()  # each token's first child: a duplicate is never accepted
        for c in tree.children[node]:
            if tree.tokens[c] not in seen:
                seen.add(tree.tokens[c])
                firsts.append(c)
        left = drawn[3 * n - 2 + node]  # mass after every child: the residual's
        after = []
        for c in reversed(firsts):
            after.append(left)
            left += drawn[c - 1]
        child = None
        for c, rest in zip(firsts, reversed(after), strict=True):
            px = drawn[c - 1]
            if px + rest > TINY and drawn[n - 1 + c - 1] < px / (px + rest):
                child = c
                break
        if child is None:
            bonus = int(drawn[2 * n - 2 + node])
            return Acceptance(tuple(path), tuple(tree.tokens[c] for c in path), bonus)
        path.append(child)
        node = child


def node_support(tree: DraftTree, node: int) -> list[int]:
    """The ids where verifying `node`'s children can change the residual: its q snapshot's ids
    and its children's tokens (in that order, each once). Outside them the residual stays
    proportional to p."""
    q = tree.q[node]
    ids = list(q.ids) if q is not None else []
    ids += [tree.tokens[c] for c in tree.children[node]]
    return list(dict.fromkeys(ids))


@dataclass(frozen=True)
class SparseNode:
    """What the host needs to verify one node's children without the dense p: p on the
    node's support (`node_support`, aligned), p's mass outside it, and a token drawn from p
    restricted to the outside (on the device, with its own uniform)."""

    support: list[int]
    p: list[float]
    mass_out: float
    outside: int


def ordered_sum(values: Iterable[float]) -> float:
    """Floats added left to right: the order the compiled kernels (`walk_compiled`,
    `stand_kernel`) add them in. From Python 3.12 the built-in `sum` compensates its rounding,
    which would leave this reference a last bit away from them."""
    return reduce(add, values, 0.0)


Residual = tuple[dict[int, float], float]
"""A residual on the host: explicit values on a node's support, and the scale `c` of p
outside it (`mass_out` × c is the outside's share); normalised, the values and c·mass_out sum
to 1."""


def _normalised(r: Residual, mass_out: float) -> Residual:
    values, c = r
    total = ordered_sum(values.values()) + c * mass_out
    if total <= TINY:
        return r
    return {s: v / total for s, v in values.items()}, c / total


def sparse_match_step(r: Residual, mass_out: float, x: int) -> tuple[float, Residual]:
    """`sample_and_match_step` on a sparse residual (`x` on the support)."""
    values, c = _normalised(r, mass_out)
    return values[x], ({**values, x: 0.0}, c)


def sparse_rrs_step(
    r: Residual, mass_out: float, qi: dict[int, float], x: int
) -> tuple[float, Residual]:
    """`rrs_step` on a sparse residual, `qi` the proposal (`_without`; its ids on the
    support): outside the support q_i is 0, so only the support's values change."""
    values, c = _normalised(r, mass_out)
    accept = min(1.0, values[x] / qi[x]) if qi.get(x, 0.0) > 0 else 0.0
    rest = {s: max(0.0, v - qi.get(s, 0.0)) for s, v in values.items()}
    if ordered_sum(rest.values()) + c * mass_out <= TINY:  # r == q_i: every draft is accepted
        return 1.0, (values, c)
    return accept, (rest, c)


class SparseNodes(Protocol):
    """A tree's `SparseNode`s by node index: gathered for every node up front (a list), or
    computed when a walk reaches them (`engine.batch.DenseNodes`)."""

    def __getitem__(self, node: int) -> SparseNode: ...


def walk_sparse(
    tree: DraftTree, nodes: SparseNodes, u: Sequence[float], w: Sequence[float]
) -> Acceptance:
    """Rules (b)-(d) (`verify_sampling`) on the host, exactly, from each node's `SparseNode`:
    neither rule changes the residual outside a node's support but by normalisation.
    `u[child]` accepts or rejects a child; `w[node]` draws the bonus from the final residual by
    inverting its CDF over the support, then the outside (whose token is `SparseNode.outside`)."""
    node, path = 0, []
    while True:
        data = nodes[node]
        r: Residual = (dict(zip(data.support, data.p, strict=True)), 1.0)
        tried, chosen = [], None
        for child in tree.children[node]:
            x = tree.tokens[child]
            accept, rest = _child_step(tree, node, child, r, data.mass_out, tried)
            if u[child] < accept:
                chosen = child
                break
            r = rest
            tried.append(x)
        if chosen is None:
            bonus = _draw(r[0], r[1] * data.mass_out, w[node], data.outside)
            return Acceptance(tuple(path), tuple(tree.tokens[v] for v in path), bonus)
        path.append(chosen)
        node = chosen


def expected_length(tree: DraftTree, nodes: SparseNodes) -> float:
    """The tokens `walk_sparse` commits on average over its uniforms, exactly: the bonus plus
    the probability of reaching each draft node. A child is chosen with the acceptance its rule
    gives it once its earlier siblings were rejected (the walk's own steps), so this is what
    the walk does, without drawing. For measuring trees (`bench/drawn_paired.py`), where one
    walk's outcome would add the verifier's noise to the comparison."""
    reach = [1.0] + [0.0] * (tree.size - 1)
    for node in range(tree.size):  # parents come before their children
        children = tree.children[node]
        if not children or reach[node] == 0.0:
            continue
        data = nodes[node]
        r: Residual = (dict(zip(data.support, data.p, strict=True)), 1.0)
        left, tried = reach[node], []
        for child in children:
            accept, r = _child_step(tree, node, child, r, data.mass_out, tried)
            reach[child] = left * accept
            left -= reach[child]
            tried.append(tree.tokens[child])
    return 1.0 + sum(reach[1:])


def _child_step(
    tree: DraftTree, node: int, child: int, r: Residual, mass_out: float, tried: list[int]
) -> tuple[float, Residual]:
    """`child`'s acceptance at `node`'s residual `r`, its earlier siblings `tried` rejected, by
    its own rule (a drawn child: rule (c) on the node's q without them; else rule (b)), and the
    residual if it is rejected."""
    x = tree.tokens[child]
    if tree.sampled[child]:
        q = tree.q[node]
        assert q is not None, "a sampled child needs its parent's q snapshot"
        return sparse_rrs_step(r, mass_out, _without(q, tried), x)
    return sparse_match_step(r, mass_out, x)


def _without(q: SparseDist, excluded: list[int]) -> dict[int, float]:
    """`proposal` on the host: q without `excluded`, renormalised (empty if nothing is left)."""
    left = {i: p for i, p in zip(q.ids, q.probs, strict=True) if i not in excluded}
    total = ordered_sum(left.values())
    return {i: p / total for i, p in left.items()} if total > 0 else {}


def _draw(r: dict[int, float], outside_mass: float, w: float, outside: int) -> int:
    """A token from the residual `r` on the support plus `outside_mass` spread as p outside it
    (`outside` was drawn from that part), at the uniform `w`."""
    total = ordered_sum(r.values()) + outside_mass
    x, cum, last = w * total, 0.0, None
    for token, v in r.items():
        if v > 0:
            last = token
            cum += v
            if x < cum:  # cumulative, as `walk_compiled._bonus_slot` compares
                return token
    if outside_mass > 0 or last is None:
        return outside
    return last  # w * total rounded past the support's mass and nothing is outside
