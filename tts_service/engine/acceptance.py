"""A decode step's acceptance: every row's accepted path and top-k from the step's logits, with
one copy back to the host.

Rules (a) and (b) run for all rows at once on the device (`engine.treebatch`). Rows whose trees
have sampled children (rule (c), recursive rejection) also need p on each node's support and a
draw from p outside it: on a GPU they are gathered on the device beside the rest
(`treebatch.gather_sparse`) and the host walks them, every row in one compiled call
(`treebatch.walk_sparse_all`); on a CPU each walk computes the nodes it reaches from the dense p
(a copy is free there). Where the step's acceptance is captured (`graphs.GraphedAcceptance`,
chosen once when the decoder is built), a batch of one set of sampling parameters replays the
bucket's capture; any other batch runs it eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch

from tts_service.engine.decode import STORE_TOPK
from tts_service.engine.graphs import GraphedAcceptance, GraphedForward, StepInputs
from tts_service.engine.sampling import SamplingParams, store_probs
from tts_service.engine.seam import NodeTopK
from tts_service.engine.streams import node_uniforms
from tts_service.engine.tree import DraftTree
from tts_service.engine.treebatch import (
    SparseLayout,
    gather_sparse,
    outside_support,
    step_verdict,
    step_verdict_walked,
    verdict,
    walk_sparse_all,
)
from tts_service.engine.treepack import TreeBatch
from tts_service.engine.verify import Acceptance, SparseNode, node_support, walk_sparse

Uniforms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # `streams.node_uniforms`'s (u, v, w)


class VerifiedRow(Protocol):
    """What acceptance reads of a row (`batch.Row`)."""

    cfg: SamplingParams
    verify_key: int
    tokens: list[int]


def sampling_key(cfg: SamplingParams) -> tuple[float, float, int, float]:
    """What p depends on (`sampling.store_probs`): rows alike in it share one computation."""
    return (cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)


def verify_streams(batch: Sequence[VerifiedRow], pad: int = 0) -> tuple[list[int], list[int]]:
    """Every row's verifier stream and counter (`streams.counter_uniforms`): its key, and its
    length (its root's position + 1, a value it never repeats); `pad` rows of zeros after them
    (a bucket's pad rows, whose draws nothing reads)."""
    keys = [r.verify_key for r in batch] + [0] * pad
    return keys, [len(r.tokens) for r in batch] + [0] * pad


def row_probs(batch: Sequence[VerifiedRow], logits: torch.Tensor) -> torch.Tensor:
    """`[R, N, V]` float64: per row `sampling.store_probs` under its own parameters, one
    computation per distinct set of them (best-of-N: one)."""
    groups: dict[tuple, list[int]] = {}
    for b, row in enumerate(batch):
        groups.setdefault(sampling_key(row.cfg), []).append(b)
    if len(groups) == 1:
        return store_probs(logits, batch[0].cfg)
    out = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    for members in groups.values():
        at = torch.tensor(members, device=logits.device)
        out[at] = store_probs(logits[at], batch[members[0]].cfg)
    return out


class DenseNodes:
    """The `SparseNode`s of one row's tree, each computed from the dense p when a walk reaches
    it (`verify.walk_sparse`): what `treebatch.gather_sparse` gathers for every node at once, for
    the visited nodes only."""

    def __init__(self, p: torch.Tensor, supports: list[list[int]], v: list[float]) -> None:
        self.p, self.supports, self.v = p, supports, v

    def __getitem__(self, node: int) -> SparseNode:
        support, device = self.supports[node], self.p.device
        ids = torch.tensor([support or [0]], dtype=torch.long, device=device)
        empty = torch.tensor([not support], device=device)
        v = torch.tensor([self.v[node]], dtype=torch.float64, device=device)
        on, mass, draw = outside_support(self.p[node][None], ids, empty, v)
        return SparseNode(support, on[0, : len(support)].tolist(), float(mass[0]), int(draw[0]))


@dataclass
class Verified:
    """What the host learned from one step's single device copy, for one row."""

    acc: Acceptance
    top: NodeTopK


@dataclass
class StepCopy:
    """One step's copy back, read on the host: per row the verdict's head (`[R, 2 + N + 2NK]`:
    meta, top-k ids, top-k probs), the gathered supports of the walked rows, and, where the
    acceptance ran eagerly, p and the uniforms a CPU walk reads."""

    head: np.ndarray
    sparse: np.ndarray
    probs: torch.Tensor | None = None
    uvw: Uniforms | None = None


class StepAcceptance:
    """Every row's acceptance and top-k from a step's logits (the decoder's `verify`). `graphs`:
    the captured forward, whose recaptures invalidate the captured acceptance's inputs;
    `captured`: the captured acceptance (None: always eager)."""

    def __init__(
        self,
        device: torch.device,
        graphs: GraphedForward | None,
        captured: GraphedAcceptance | None,
    ) -> None:
        self.device, self.graphs, self.captured = device, graphs, captured
        self.epoch = graphs.epoch if graphs is not None else 0  # the forward's captures read
        # rule (c): gather every node's support on the device, for one copy (a GPU); else
        # compute the nodes a walk reaches from the dense p (a CPU, where a copy is free)
        self.gather_sparse = device.type == "cuda"

    def __call__(
        self,
        batch: Sequence[VerifiedRow],
        trees: list[DraftTree],
        logits: torch.Tensor,
        tb: TreeBatch,
        static: StepInputs | None = None,
    ) -> list[Verified]:
        """`logits` `[R, N, V]`; with `static` (the bucket's captured-acceptance inputs) `tb`
        and `logits` are the whole bucket's."""
        rows, n = len(batch), tb.shape[1]
        k = min(STORE_TOPK, logits.shape[-1])
        walk = [b for b, t in enumerate(trees) if not batch[b].cfg.greedy and any(t.sampled)]
        layout = None  # rule (c)'s trees laid out for the device's gather
        if walk and (self.gather_sparse or static is not None):
            layout = SparseLayout.of([trees[b] for b in walk], n, bucket=static is not None)
        copy = None
        if static is not None:
            copy = self._replayed(batch, logits, static, (n, k), walk, layout)
        if copy is None:
            if static is not None:  # eagerly, on the bucket's real rows
                logits, tb = logits[:rows], tb.head(rows)
            copy = self._eager(batch, logits, tb, k, walk, layout)
        walked = self._walks(trees, walk, layout, copy)
        head = copy.head
        meta = head[:, : 2 + n].tolist()
        # copies (`astype`, `copy`): the drafters keep them past the step, and the host's
        # buffer may be reused
        top_ids = head[:, 2 + n : 2 + n + n * k].reshape(rows, n, k).astype(np.int64)
        top_probs = head[:, 2 + n + n * k :].reshape(rows, n, k).copy()
        out = []
        for b, (tree, m) in enumerate(zip(trees, meta, strict=True)):
            acc = walked.get(b)
            if acc is None:
                path = tuple(i for i in range(1, tree.size) if m[2 + i])
                acc = Acceptance(path, tuple(tree.tokens[i] for i in path), int(m[1]))
            out.append(Verified(acc, NodeTopK(top_ids[b], top_probs[b])))
        return out

    def _eager(
        self,
        batch: Sequence[VerifiedRow],
        logits: torch.Tensor,
        tb: TreeBatch,
        k: int,
        walk: list[int],
        layout: SparseLayout | None,
    ) -> StepCopy:
        """Rules (a) and (b) for every row, and rule (c)'s gather where laid out, in eager ops
        ending in the step's one synchronisation."""
        greedy = [r.cfg.greedy for r in batch]
        n = tb.shape[1]
        probs = row_probs(batch, logits)  # sampled rows: p itself
        uvw = None if all(greedy) else node_uniforms(*verify_streams(batch), n, self.device)
        mixed = uvw is not None and any(greedy)
        on = torch.tensor(greedy, device=self.device) if mixed else None
        main = verdict(tb, logits, probs, k, None if uvw is None else uvw[:2], on)
        if layout is None:
            host = main.cpu().numpy()
        else:
            assert uvw is not None
            at = torch.tensor(walk, dtype=torch.long, device=self.device)
            u, v, w = (x[at] for x in uvw)
            rule_c = gather_sparse(probs[at], layout, u, v, w)
            host = torch.cat([main.flatten(), rule_c.flatten()]).cpu().numpy()
        head = host[: main.numel()].reshape(main.shape)
        sparse = host[main.numel() :].reshape(len(walk), n, -1) if layout else host[:0]
        return StepCopy(head, sparse, probs, uvw)

    def _walks(
        self,
        trees: list[DraftTree],
        walk: list[int],
        layout: SparseLayout | None,
        copy: StepCopy,
    ) -> dict[int, Acceptance]:
        """Rule (c)'s acceptance of each walked row: every row at once from the gathered
        supports (`walk_sparse_all`), or each row from the dense p (a CPU)."""
        if layout is not None:
            return dict(zip(walk, walk_sparse_all(layout, copy.sparse), strict=True))
        walked = {}
        for b in walk:
            assert copy.uvw is not None and copy.probs is not None
            u, v, w = (x[b].tolist() for x in copy.uvw)
            supports = [node_support(trees[b], j) for j in range(trees[b].size)]
            walked[b] = walk_sparse(trees[b], DenseNodes(copy.probs[b], supports, v), u, w)
        return walked

    def _replayed(
        self,
        batch: Sequence[VerifiedRow],
        logits: torch.Tensor,
        static: StepInputs,
        widths: tuple[int, int],
        walk: list[int],
        layout: SparseLayout | None,
    ) -> StepCopy | None:
        """The whole bucket's acceptance through its captured graph (`treebatch.step_verdict`,
        or with walked rows `step_verdict_walked`), read back for the batch's rows; None where
        the rows do not share one set of sampling parameters or the capture failed. `widths`:
        the step's tokens a row and top-k."""
        assert self.captured is not None
        n, k = widths
        cfg = batch[0].cfg
        params = sampling_key(cfg)
        if any(sampling_key(r.cfg) != params for r in batch):
            return None
        if self.graphs is not None and self.graphs.epoch != self.epoch:
            self.captured.clear()  # the forward's logits buffers were captured again
            self.epoch = self.graphs.epoch
        bucket, tokens = static.ints.shape[0], static.masks.shape[-1]
        inputs: tuple[torch.Tensor, ...] = (logits, *static.trees)
        if not cfg.greedy:  # the uniforms: filled before the forward (`BatchDecoder.step`)
            inputs = (*inputs, static.uvw)
        if layout is None:
            key: tuple = ((bucket, tokens), params, k)
            flat = self.captured(key, partial(step_verdict, cfg, k), inputs)
        else:
            supports = self.captured.supports(layout.supports(walk, bucket))
            key = ((bucket, tokens), params, k, supports.shape[-1])
            fn = partial(step_verdict_walked, cfg, k)
            flat = self.captured(key, fn, (*inputs, supports))
        if flat is None:
            return None
        host, size = self.captured.to_host(flat), bucket * (2 + n + 2 * n * k)
        head = host[:size].reshape(bucket, -1)[: len(batch)]
        return StepCopy(head, host[size:].reshape(bucket, n, -1)[walk])
