"""Continuous batched speculative decoding: rows decode together, each with its own draft tree,
in one target forward per step; rows join a running batch and leave it when they finish.

One preallocated KV cache holds the batch (`engine.kv.StaticKV`). A row's valid entries need not
be contiguous: a row that joins is prefilled on its own and spliced in left padded, and after
each step a row keeps only its root and accepted nodes at the front of the step's new region;
the rest of that region becomes a hole. The cache's `valid[b, s]` says which slots row b may
attend to, and positions are logical (prefix length + depth), so holes change nothing a row
computes. When holes outnumber entries the cache is compacted in place. Every row commits
exactly what it would alone (greedy: the same tokens; sampling: the same distribution, from the
row's own random stream).

One step is draft -> pack -> forward -> verify -> accept -> compact KV -> observe. The verify
work runs on the device for every row at once, and the host reads its results with one copy
(one synchronisation per step): the argmax and the drafters' top-k at every node, and for
sampled rows over deterministic drafts the draws of `verify.draw_match`. Only trees with
sampled children (recursive rejection sampling) walk node by node on the device. On CUDA the
forward can be a captured graph (`engine.graphs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.engine.attention import use_grouped_attention
from tts_service.engine.collector import collect_in_shadow
from tts_service.engine.cost import sync_device
from tts_service.engine.decode import STORE_TOPK, GenerationResult, OnCommit, StopRule
from tts_service.engine.graphs import (
    MAX_TOKENS,
    EagerReplayedAcceptance,
    GraphedAcceptance,
    GraphedForward,
    StepInputs,
    bucket_shape,
    forward_at,
)
from tts_service.engine.kv import (
    LayerKV,
    PrefilledRows,
    PromptCache,
    StaticKV,
    fill_holes,
    padded_rows,
)
from tts_service.engine.metrics import ForwardStats, GenerationStats, StepPhases
from tts_service.engine.sampling import SamplingParams, store_probs
from tts_service.engine.seam import (
    OBSERVE_TAIL,
    Deferred,
    DeferredObservations,
    DraftContext,
    Drafter,
    NodeTopK,
    draft_all,
)
from tts_service.engine.streams import Stream, node_uniform_block, node_uniforms, stream_seed
from tts_service.engine.tree import DraftTree
from tts_service.engine.treebatch import (
    WALK_ALL_FROM,
    GatheredNodes,
    SparseLayout,
    TreeBatch,
    gather_sparse,
    outside_support,
    step_verdict,
    step_verdict_walked,
    verdict,
    walk_sparse_all,
)
from tts_service.engine.verify import Acceptance, SparseNode, node_support, walk_sparse


def _params(cfg: SamplingParams) -> tuple[float, float, int, float]:
    """What p depends on (`sampling.store_probs`): rows alike in it share one computation."""
    return (cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)


@dataclass(eq=False)
class Row:
    """One trajectory in the batch. The runner's rows extend it with their request
    (`runner.TrajectoryRow`)."""

    prompt_ids: list[int]
    drafter: Drafter
    cfg: SamplingParams
    rule: StopRule
    tokens: list[int] = field(init=False)
    verify_key: int = field(init=False)  # the verifier's stream (`streams.counter_uniforms`)
    stats: GenerationStats = field(default_factory=GenerationStats)
    joined_at: float = 0.0
    error: Exception | None = None  # its drafter or stop rule failed: it leaves, alone

    def __post_init__(self) -> None:
        if not self.prompt_ids:  # the last prompt token is the first step's root
            raise ValueError("prompt_ids must not be empty")
        self.tokens = list(self.prompt_ids)
        # the engine's frozen copy (callers may pass a config)
        self.cfg = SamplingParams.of(self.cfg)
        self.verify_key = stream_seed(self.cfg.seed, Stream.VERIFY, self.cfg.salt)

    def commit(self, tree: DraftTree, acc: Acceptance) -> tuple[int, Acceptance]:
        """Commit a verified step's tokens up to the row's stop and count the step; returns how
        many were committed and the acceptance of those alone (what the drafters learn)."""
        committed = self.rule.push(acc.committed)
        self.tokens.extend(acc.committed[:committed])
        self.stats.record_step(tree.size - 1, min(acc.num_accepted, committed), committed)
        return committed, acc.upto(committed)

    def result(self) -> GenerationResult:
        return GenerationResult(
            tuple(self.rule.out), self.rule.finish, self.stats, self.rule.stop_text
        )


StepObserver = Callable[[Row, DraftTree, Acceptance], None]


def _guarded(row: Row, later: Deferred) -> Deferred:
    """`later`, failing its row alone (`Row.error`) if it raises."""

    def run() -> None:
        try:
            later()
        except Exception as e:  # noqa: BLE001 - the row's own failure, reported with it
            row.error = e

    return run


Uniforms = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # `streams.node_uniforms`'s (u, v, w)


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


class BatchDecoder:
    """The rows decoding now, their shared KV cache, and the per-forward counters.

    `cuda_graphs`: capture the verify forward per (rows, tokens) bucket on a CUDA device
    (ignored elsewhere); `full_view` makes attention span the whole preallocated cache, the
    static shapes graphs need (on by itself with graphs; tests turn it on to check the masks
    graphs use on a CPU). `cache`: one of the caller's (a tensor-parallel leader's mirrors its
    rewrites to the other ranks, `engine.tp`). `prompt_cache`: keep recent prompts' prefilled
    KV, so a prompt is prefilled once however its rows join. `defer_observation`: what the
    drafters defer of observing a step runs during the next forward (False: at once, the
    reference the tests compare with). `grouped_attention`: run an SDPA model's tree steps over
    each KV head once (`engine.attention`; None: on a CUDA device, where the copies it saves
    cost more than the step). `graph_acceptance`: capture the step's acceptance too, per bucket
    (`graphs.GraphedAcceptance`, on CUDA with `cuda_graphs`: it reads the captured forward's
    logits in place; on a CPU, `graphs.EagerReplayedAcceptance`: the same path run eagerly, as
    the tests and the host benchmark check it). None: wherever the forward is captured."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        compact_slack: int = 64,
        cuda_graphs: bool = True,
        full_view: bool = False,
        cache: StaticKV | None = None,
        prompt_cache: bool = True,
        defer_observation: bool = True,
        grouped_attention: bool | None = None,
        graph_acceptance: bool | None = None,
    ) -> None:
        self.model = model
        if model.device.type == "cuda" if grouped_attention is None else grouped_attention:
            use_grouped_attention(model)
        # the prompts' prefilled KV, kept for rows that join later (none where the cache is
        # mirrored: a tensor-parallel follower prefills beside its leader)
        self.prompts = PromptCache() if prompt_cache else None
        self.compact_slack = compact_slack
        self.eos_ids = list(eos_ids)
        self.decode = decode
        self.min = torch.finfo(model.dtype).min
        # attend: 0, blocked: `min` (an additive mask in the model's dtype), one op a step
        self.zero = torch.zeros((), dtype=model.dtype, device=model.device)
        self.active: list[Row] = []
        self.cache = cache if cache is not None else StaticKV(model)
        graphs = cuda_graphs and model.device.type == "cuda"
        self.graphs = GraphedForward(model, self.cache) if graphs else None
        self.cache.full_view = full_view or graphs
        self.accept_graphs: GraphedAcceptance | None = None
        if graph_acceptance is None:
            graph_acceptance = graphs
        if graph_acceptance and model.device.type != "cuda":
            self.accept_graphs = EagerReplayedAcceptance(model.device)
        elif graph_acceptance and graphs:  # it reads the captured forward's logits in place
            self.accept_graphs = GraphedAcceptance(model.device)
        self.accept_epoch = self.cache.epoch
        self.forwards = ForwardStats()
        self.phases = StepPhases()
        self.defer_observation = defer_observation
        # rule (c): gather every node's support on the device, for one copy (a GPU); else
        # compute the nodes a walk reaches from the dense p (a CPU, where a copy is free)
        self.gather_sparse = model.device.type == "cuda"
        self.deferred = DeferredObservations()  # run during the next forward

    @property
    def context_len(self) -> int:
        """Slots in use: what attention spans (before the step's tokens)."""
        return self.cache.length

    @property
    def last_step_steady(self) -> bool:
        """The last step's forward ran as its shape will keep running (not the step that captured
        its CUDA graph, its warm-up included): its time may teach the cost surface."""
        return self.graphs is None or self.graphs.last_steady

    @property
    def graph_tokens(self) -> int | None:
        """The largest padded step (rows × tokens) replayed as a CUDA graph; None: no graphs
        (every step runs alike)."""
        return MAX_TOKENS if self.graphs is not None and self.graphs.enabled else None

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _shape(self, rows: int, width: int) -> tuple[int, int]:
        """The (rows, tokens) a step of this size runs at: its graph bucket where the forward or
        the acceptance is captured."""
        if self.graphs is not None:
            return self.graphs.bucket(rows, width)
        if self.accept_graphs is not None and self.accept_graphs.enabled:
            return bucket_shape(rows, width)
        return rows, width

    def stop_rule(self, cfg: SamplingParams, on_commit: OnCommit | None = None) -> StopRule:
        """Where a row of this model stops (its EOS ids, stop strings through its tokenizer)."""
        return StopRule(cfg, self.eos_ids, self.decode, on_commit)

    def new_row(
        self,
        prompt_ids: list[int],
        drafter: Drafter,
        cfg: SamplingParams,
        on_commit: OnCommit | None = None,
    ) -> Row:
        return Row(list(prompt_ids), drafter, cfg, self.stop_rule(cfg, on_commit))

    @torch.inference_mode()
    def join(self, rows: list[Row]) -> None:
        """Add rows: their prompts (all but the root) prefilled in one forward, each distinct
        prompt once, or taken from the prompt cache."""
        t0 = time.perf_counter()
        prompts = [tuple(r.tokens[:-1]) for r in rows]
        unique = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
        shared = len(unique) < len(rows)  # best-of-N: one prefill per distinct prompt
        source = torch.tensor([unique[p] for p in prompts], dtype=torch.long) if shared else None
        if self.prompts is None:
            cache, valid = self._prefill([list(p) for p in unique])
            self.cache.append_rows(cache, valid, source)
        else:
            prefilled = self._cached_prefill(list(unique))
            self.cache.append_rows(prefilled, prefilled.valid, source)
        for row in rows:
            row.drafter.start(row.tokens)
            row.joined_at = t0
        self.active.extend(rows)
        self.forwards.prefill_s += time.perf_counter() - t0

    @torch.inference_mode()
    def drop(self, rows: list[Row]) -> None:
        """Take active rows out of the batch (cancelled from outside: early stop, disconnect)."""
        if not rows:
            return
        self.flush_observations()
        gone = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.active) if id(r) not in gone]
        if len(keep) < len(self.active):
            self._keep_rows(keep)

    def reset(self) -> None:
        """Drop every row, and the KV rows a failed join had appended with no row to drop."""
        self.drop(list(self.active))
        self.cache.clear()

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:  # an empty batch starts over at slot 0
            self.active = []
            self.cache.clear()
            return
        order = fill_holes(keep)
        self.cache.select_rows(order)
        self.active = [self.active[b] for b in order]

    def _cached_prefill(self, prompts: list[tuple[int, ...]]) -> PrefilledRows:
        """The prompts' prefilled KV: those the prompt cache lacks are prefilled together
        first, and kept (more new prompts than the cache keeps are still all used here)."""
        cache = self.prompts
        assert cache is not None
        entries = {p: e for p in prompts if (e := cache.get(p)) is not None}
        missing = [p for p in prompts if p not in entries]
        if missing:
            new, _ = self._prefill([list(p) for p in missing])
            for i, p in enumerate(missing):
                n = len(p)
                entries[p] = (
                    [
                        LayerKV(
                            layer.keys[i : i + 1, :, layer.keys.shape[2] - n :].clone(),
                            layer.values[i : i + 1, :, layer.values.shape[2] - n :].clone(),
                        )
                        for layer in new.layers
                    ]
                    if n
                    else []
                )
                cache.put(p, entries[p])
        return padded_rows(prompts, [entries[p] for p in prompts])

    def _prefill(self, prompts: list[list[int]]) -> tuple[DynamicCache, torch.Tensor]:
        """Left-padded prefill of `prompts` (each a row's tokens but its root), into a cache
        of their own."""
        device = self.model.device
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        cache = DynamicCache(config=self.model.config)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        if width == 0:
            return cache, valid
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        pos = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for b, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            if n:
                ids[b, width - n :] = torch.tensor(prompt, device=device)
                pos[b, width - n :] = torch.arange(n, device=device)
                valid[b, width - n :] = True
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(
            width, dtype=torch.bool, device=device
        )[None]
        self.model(
            ids,
            attention_mask=self.zero.where(allowed, self.min)[:, None],
            position_ids=pos,
            past_key_values=cache,
            logits_to_keep=1,
        )
        return cache, valid

    def _pack(self, tb: TreeBatch, shape: tuple[int, int]):
        """Batched inputs padded to `shape` = (rows, tokens): `[R, N]` ids and positions and the
        `[R, 1, N, K]` mask, K the key width attention sees (the slots in use plus the tree's,
        or the whole cache under `full_view`). Pad rows and pad nodes attend to themselves."""
        device, kv = self.model.device, self.cache
        rows, n = shape
        start = kv.length
        width = kv.capacity if kv.full_view else start + n
        r, w = tb.shape
        ids, pos, anc = tb.tokens, tb.positions, tb.ancestors
        if (r, w) != (rows, n):  # a graph bucket's extra rows and tokens: each sees itself alone
            ids = torch.nn.functional.pad(ids, (0, n - w, 0, rows - r))
            pos = torch.nn.functional.pad(pos, (0, n - w, 0, rows - r))
            anc = torch.eye(n, dtype=torch.bool, device=device).repeat(rows, 1, 1)
            anc[:r, :w, :w] = tb.ancestors
        allowed = torch.zeros(rows, n, width, dtype=torch.bool, device=device)
        allowed[:, :, :start] = kv.valid[:rows, None, :start]
        allowed[:, :, start : start + n] = anc
        return ids, pos, self.zero.where(allowed, self.min)[:, None]

    @torch.inference_mode()
    def step(
        self, max_nodes: int, observe: StepObserver | None = None, fill: bool = False
    ) -> list[Row]:
        """One forward for every active row, each drafting at most `max_nodes` nodes (with
        `fill`, the whole budget: `DraftContext.fill`); `observe` sees every row's tree and
        acceptance (the allocator's statistics).

        With `max_nodes` 0 the step is plain decoding: no drafter is asked for a tree, and
        each learns from the target's distribution at its root (`Drafter.observe_root`).
        What the drafters defer of their observation of this step (`Drafter.observe` returns
        it) runs during the next step's forward: drafting for step t + 1 sees the observations
        of steps up to t - 1, in row order, deterministically.
        Returns the rows that finished (they have left the batch)."""
        batch = self.active
        plain = max_nodes == 0
        before = [len(r.tokens) for r in batch] if plain else None  # the roots' contexts
        clock = self.phases.clock
        marks = [clock()]
        # 1. draft, one tree per row
        trees = self._draft(batch, max_nodes, fill)
        marks.append(clock())
        # 2-3. pack and one forward for the whole batch
        start = self.cache.length
        width = max(t.size for t in trees)
        shape = self._shape(len(batch), width)
        self.cache.reserve(shape[0], start + shape[1])
        static = self.accept_graphs.inputs(*shape) if self.accept_graphs is not None else None
        roots = [len(r.tokens) - 1 for r in batch]
        if static is None:
            tb = TreeBatch.of(trees, width, self.device, roots)
        else:  # the whole bucket, written to its captured acceptance's inputs
            pad = shape[0] - len(trees)
            trees_b, roots_b = trees + [DraftTree.root_only(0)] * pad, roots + [0] * pad
            uniforms = None
            if not all(r.cfg.greedy for r in batch):  # copied while the device is still free
                keys, counters = self._verify_streams(batch, pad)
                uniforms = node_uniform_block(keys, counters, shape[1])
            tb = static.fill(trees_b, roots_b, uniforms)
        ids, pos, mask = self._pack(tb, shape)
        marks.append(clock())
        logits = self._forward(ids, pos, mask, start)  # [R, N, V]
        marks.append(clock())
        # the last step's deferred observation and the collector's pass, while the device runs
        # this forward
        self.flush_observations()
        collect_in_shadow()
        marks.append(clock())
        # 4-5. verify (on the device, one copy back) and accept
        if static is None:
            logits = logits[: len(batch), :width]
        verified = self.verify(batch, trees, logits, tb, static)
        marks.append(clock())
        keeps, committed = self._accept(batch, trees, verified)
        marks.append(clock())
        # 6. compact KV: each row keeps root + accepted path at the front of the new region
        finished = self._keep(start, keeps)
        marks.append(clock())
        # 7. observe: every drafter learns (what it defers runs in the next forward)
        self._observe(batch, trees, verified, before, observe)
        if not self.active or not self.defer_observation:  # no next forward to hide it under
            self.flush_observations()
        marks.append(clock())
        self.phases.record(marks)
        t0, t1, t2, t3 = marks[0], marks[1], marks[7], marks[8]
        for row in batch:  # one forward for all: each row is booked an equal share
            row.stats.draft_s += ((t1 - t0) + (t3 - t2)) / len(batch)
            row.stats.verify_s += (t2 - t1) / len(batch)
        for row in finished:
            row.stats.wall_s = t3 - row.joined_at  # the row's own latency, join to finish
        nodes = sum(t.size - 1 for t in trees)
        self.forwards.record(len(batch), width, nodes, committed, t1 - t0, t2 - t1, t3 - t2, start)
        return finished

    def _observe(
        self,
        batch: list[Row],
        trees: list[DraftTree],
        verified: list[Verified],
        plain: list[int] | None,
        observe: StepObserver | None,
    ) -> None:
        """Every row's drafter observes the step; what it defers is kept for the next forward.
        `plain`: on a plain step, each row's length before it (its root's context)."""
        for b, (row, tree, v) in enumerate(zip(batch, trees, verified, strict=True)):
            if row.error is not None:
                continue
            try:
                if plain is not None:
                    n = plain[b]
                    tail = row.tokens[max(0, n - OBSERVE_TAIL) : n]
                    later = row.drafter.observe_root(tail, v.top)
                else:
                    later = row.drafter.observe(tree, v.acc, v.top)
                    if observe is not None:
                        observe(row, tree, v.acc)
            except Exception as e:  # noqa: BLE001 - a row still in the batch: the runner drops it
                row.error, later = e, None
            self.deferred.add(None if later is None else _guarded(row, later))

    def flush_observations(self) -> None:
        """Run the observation the drafters deferred (in the order they deferred it)."""
        self.deferred.run()

    def _draft(self, batch: list[Row], max_nodes: int, fill: bool) -> list[DraftTree]:
        """Every row's tree: its drafter's, or the root alone on a plain step. A drafter that
        raises fails its own row (`Row.error`: it takes this step plain, then leaves); the
        others draft again, each alone, so one bad row never fails the batch."""
        if max_nodes == 0:
            return [DraftTree.root_only(r.tokens[-1]) for r in batch]
        ctxs = [
            DraftContext(r.tokens, len(r.prompt_ids), max_nodes, r.cfg.greedy, fill) for r in batch
        ]
        try:
            return draft_all([r.drafter for r in batch], ctxs)
        except Exception:  # find the row(s) at fault
            trees = []
            for row, ctx in zip(batch, ctxs, strict=True):
                try:
                    trees += draft_all([row.drafter], [ctx])
                except Exception as e:  # noqa: BLE001 - the row's own failure, reported with it
                    row.error = e
                    trees.append(DraftTree.root_only(row.tokens[-1]))
            return trees

    def _accept(
        self, batch: list[Row], trees: list[DraftTree], verified: list[Verified]
    ) -> tuple[list[list[int]], int]:
        """Commit every row's accepted tokens (up to its stop); the tree nodes each row keeps
        (root + accepted path) and the tokens committed in all."""
        keeps, total = [], 0
        for row, tree, v in zip(batch, trees, verified, strict=True):
            try:
                committed, v.acc = row.commit(tree, v.acc)
            except Exception as e:  # noqa: BLE001 - its stop rule failed: it leaves, alone
                row.error, committed = e, 0
            keeps.append([0] if row.error is not None else [0, *v.acc.path])
            total += committed
        return keeps, total

    def _keep(self, start: int, keeps: list[list[int]]) -> list[Row]:
        """Keep each row's `keeps` at the front of the step's region, let finished rows leave
        and compact when holes outnumber entries; returns the finished rows."""
        batch = self.active
        m = max(len(k) for k in keeps)
        if m == 1:  # every row keeps its root alone, where the forward wrote it
            self.cache.keep_roots(start)
        else:
            keep = np.array([k + [-1] * (m - len(k)) for k in keeps], dtype=np.int64)
            self.cache.keep_region(start, keep)
        finished = [r for r in batch if r.rule.finish is not None or r.error is not None]
        if finished:  # finished (and failed) rows leave the batch
            self._keep_rows([b for b, r in enumerate(batch) if r not in finished])
        # a row holds its tokens but the root in the cache: its entries, counted on the host (a
        # count read back from the device would be a second synchronisation per step)
        entries = max((len(r.tokens) - 1 for r in self.active), default=0)
        if self.active and self.cache.length > 2 * entries + self.compact_slack:
            self._compact()
        return finished

    def verify(
        self,
        batch: list[Row],
        trees: list[DraftTree],
        logits: torch.Tensor,
        tb: TreeBatch,
        static: StepInputs | None = None,
    ) -> list[Verified]:
        """Every row's acceptance and top-k from `logits` (`[R, N, V]`), with one copy back:
        rules (a) and (b) for all rows at once on the device (`engine.treebatch`); for rows
        whose trees have sampled children (rule (c)), p on each node's support and a draw from
        p outside it, which the host walks for all of them at once
        (`treebatch.walk_sparse_all`; on a CPU, row by row from the dense p). With `static`
        (the bucket's captured-acceptance inputs, `tb` and `logits` the whole bucket's), a
        batch of one set of sampling parameters replays the captured acceptance (with rule (c)'s
        gather, where rows are walked). Timing replay overrides it (acceptance that follows a log,
        `tts_service.replay.LoggedBatchDecoder`)."""
        rows, n = len(batch), tb.shape[1]
        k = min(STORE_TOPK, logits.shape[-1])
        greedy = [r.cfg.greedy for r in batch]
        walk = [b for b, t in enumerate(trees) if not greedy[b] and any(t.sampled)]
        probs = uvw = None
        # rule (c)'s trees laid out for the device's gather (a bucket's: at its static width)
        layout = None
        if walk and (self.gather_sparse or static is not None):
            layout = SparseLayout.of([trees[b] for b in walk], n, bucket=static is not None)
        flat = None
        if static is not None:
            flat = self._replay_acceptance(batch, logits, static, k, walk, layout)
        if flat is not None:  # the whole bucket's, pad rows included: the step's one sync
            assert static is not None
            assert self.accept_graphs is not None
            host, bucket = self.accept_graphs.to_host(flat), static.ints.shape[0]
            size = bucket * (2 + n + 2 * n * k)
            head = host[:size].reshape(bucket, -1)[:rows]
            sparse = host[size:].reshape(bucket, n, -1)[walk]
        else:
            if static is not None:  # eagerly, on the bucket's real rows
                logits, tb = logits[:rows], tb.head(rows)
            probs = self._store_probs(batch, logits)  # sampled rows: p itself
            uvw = None if all(greedy) else self._uniforms(batch, n)
            mixed = uvw is not None and any(greedy)
            on = torch.tensor(greedy, device=self.device) if mixed else None
            uv = None if uvw is None else (uvw[0], uvw[1])
            main = verdict(tb, logits, probs, k, uv, on)
            if layout is None:  # the step's one synchronisation; the host reads numpy arrays
                host = main.cpu().numpy()
            else:
                assert uvw is not None
                at = torch.tensor(walk, dtype=torch.long, device=self.device)
                u, v, w = (x[at] for x in uvw)
                rule_c = gather_sparse(probs[at], layout, u, v, w)
                host = torch.cat([main.flatten(), rule_c.flatten()]).cpu().numpy()
            head = host[: main.numel()].reshape(main.shape)
            sparse = host[main.numel() :].reshape(len(walk), n, -1) if layout else host[:0]
        meta = head[:, : 2 + n]
        # copies (`astype`, `copy`): the drafters keep them past the step, and `host` may be a
        # reused buffer
        top_ids = head[:, 2 + n : 2 + n + n * k].reshape(rows, n, k).astype(np.int64)
        top_probs = head[:, 2 + n + n * k :].reshape(rows, n, k).copy()
        walked: dict[int, Acceptance] = {}
        if layout is not None and len(walk) >= WALK_ALL_FROM:  # every walked row at once
            walked = dict(zip(walk, walk_sparse_all(layout, sparse), strict=True))
        elif layout is not None:  # a few rows: each walks the nodes it reaches
            for i, b in enumerate(walk):
                nodes = GatheredNodes(layout, sparse, i)
                walked[b] = walk_sparse(trees[b], nodes, nodes.u, nodes.w)
        else:  # on a CPU: each visited node from the dense p, only the nodes the walks reach
            for b in walk:
                assert uvw is not None and probs is not None
                u, v, w = (x[b].tolist() for x in uvw)
                nodes = [node_support(trees[b], i) for i in range(trees[b].size)]
                walked[b] = walk_sparse(trees[b], DenseNodes(probs[b], nodes, v), u, w)
        out = []
        for b, (tree, m) in enumerate(zip(trees, meta.tolist(), strict=True)):
            acc = walked.get(b)
            if acc is None:
                path = tuple(i for i in range(1, tree.size) if m[2 + i])
                acc = Acceptance(path, tuple(tree.tokens[i] for i in path), int(m[1]))
            out.append(Verified(acc, NodeTopK(top_ids[b], top_probs[b])))
        return out

    @staticmethod
    def _verify_streams(batch: list[Row], pad: int = 0) -> tuple[list[int], list[int]]:
        """Every row's verifier stream and counter (`streams.counter_uniforms`): its key, and
        its length (its root's position + 1, a value it never repeats); `pad` rows of zeros
        after them (a bucket's pad rows, whose draws nothing reads)."""
        keys = [r.verify_key for r in batch] + [0] * pad
        return keys, [len(r.tokens) for r in batch] + [0] * pad

    def _uniforms(self, batch: list[Row], n: int) -> Uniforms:
        """Every row's (u, v, w) at its `n` nodes (`streams.node_uniforms`)."""
        return node_uniforms(*self._verify_streams(batch), n, self.device)

    def _replay_acceptance(
        self,
        batch: list[Row],
        logits: torch.Tensor,
        static: StepInputs,
        k: int,
        walk: list[int],
        layout: SparseLayout | None,
    ) -> torch.Tensor | None:
        """The whole bucket's acceptance (`logits` and the trees in `static`, pad rows included)
        through its captured graph: `treebatch.step_verdict`, or with rows that rule (c) walks
        (`walk`, laid out in `layout`) `step_verdict_walked` (flat); None where the rows do
        not share one set of sampling parameters or the capture failed (the caller runs it
        eagerly)."""
        assert self.accept_graphs is not None
        cfg = batch[0].cfg
        params = _params(cfg)
        if any(_params(r.cfg) != params for r in batch):
            return None
        if self.graphs is not None and self.graphs.epoch != self.accept_epoch:
            self.accept_graphs.clear()  # the forward's logits buffers were captured again
            self.accept_epoch = self.graphs.epoch
        shape = (static.ints.shape[0], static.masks.shape[-1])
        inputs: tuple[torch.Tensor, ...] = (logits, *static.trees)
        if not cfg.greedy:  # the uniforms: filled before the forward (`step`)
            inputs = (*inputs, static.uvw)
        if layout is None:
            return self.accept_graphs((shape, params, k), partial(step_verdict, cfg, k), inputs)
        supports = self.accept_graphs.supports(layout.supports(walk, shape[0]))
        key = (shape, params, k, supports.shape[-1])
        fn = partial(step_verdict_walked, cfg, k)
        return self.accept_graphs(key, fn, (*inputs, supports))

    def _store_probs(self, batch: list[Row], logits: torch.Tensor) -> torch.Tensor:
        """`[R, N, V]` float64: per row `sampling.store_probs` under its own parameters, one
        computation per distinct set of them (best-of-N: one)."""
        groups: dict[tuple, list[int]] = {}
        for b, row in enumerate(batch):
            groups.setdefault(_params(row.cfg), []).append(b)
        if len(groups) == 1:
            return store_probs(logits, batch[0].cfg)
        out = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
        for members in groups.values():
            at = torch.tensor(members, device=logits.device)
            out[at] = store_probs(logits[at], batch[members[0]].cfg)
        return out

    def _forward(self, ids, pos, mask, start: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(ids, pos, mask, start)
        slots = None
        if self.cache.full_view:  # the write slots a graph would take from a device tensor
            slots = torch.arange(start, start + ids.shape[1], device=ids.device)
        return forward_at(self.model, self.cache, ids, pos, mask, slots)

    # -- cost measurement --------------------------------------------------------------------
    @torch.inference_mode()
    def fill_random(self, rows: int, context_len: int, seed: int = 0) -> None:
        """`rows` rows of `context_len` random cache entries and no real rows: attention costs
        as much as over real ones, without prefilling (16 × 4096 tokens take minutes on a CPU).
        For measuring forwards (`time_forward`); rows joined later start from here."""
        kv = self.cache
        self.active = []
        kv.clear()
        kv.reserve(rows, context_len + 1)
        gen = torch.Generator(device=kv.device).manual_seed(seed)
        for layer in kv.layers:
            for buf in (layer.keys, layer.values):
                buf[:rows, :, :context_len].normal_(generator=gen)
        kv.valid[:rows, :context_len] = True
        kv.rows, kv.length = rows, context_len

    @torch.inference_mode()
    def time_forward(self, rows: int, width: int) -> float:
        """Seconds of one verify step's device work, `rows` trees of `width` tokens over the
        cache as it is: pack, forward (on a GPU a graph, captured at the first timing where the
        shape fits one), argmax and the host copy. The written slots are discarded."""
        start = self.cache.length
        trees = [DraftTree.chain(1, [1] * (width - 1))] * rows
        shape = self.graphs.bucket(rows, width) if self.graphs else (rows, width)
        self.cache.reserve(shape[0], start + shape[1])
        sync_device(self.model.device)
        t0 = time.perf_counter()
        tb = TreeBatch.of(trees, width, self.device, [start] * rows)
        ids, pos, mask = self._pack(tb, shape)
        self._forward(ids, pos, mask, start)[:rows, :width].argmax(-1).cpu()
        seconds = time.perf_counter() - t0
        self.cache.length = start
        return seconds

    def _compact(self) -> None:
        """Right-align every row's valid slots and drop the holes (a stable sort puts each
        row's holes first, its slots after them in order)."""
        valid = self.cache.active_valid()
        width = int(valid.sum(1).max())
        order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices
        self.cache.gather_slots(order[:, -width:].contiguous(), valid.gather(1, order[:, -width:]))
