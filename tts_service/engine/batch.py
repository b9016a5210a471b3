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

One step is draft -> pack -> forward -> verify -> accept -> compact KV -> observe, each phase
one method and timed by name (`metrics.StepTimer`). The verify work runs on the device for
every row at once, and the host reads its results with one copy (one synchronisation per
step; `engine.acceptance`, eager or captured, chosen when the decoder is built). On CUDA the
forward can be a captured graph (`engine.graphs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from tts_service.engine.acceptance import StepAcceptance, Verified, verify_streams
from tts_service.engine.attention import use_grouped_attention
from tts_service.engine.collector import collect_in_shadow
from tts_service.engine.cost import sync_device
from tts_service.engine.decode import GenerationResult, OnCommit, StopRule
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
    PromptCache,
    StaticKV,
    fill_holes,
    padded_rows,
    prompt_cache_bytes,
    trim_host_memory,
)
from tts_service.engine.metrics import ForwardStats, GenerationStats, StepPhases, StepTimer
from tts_service.engine.options import DEFAULTS, DecoderOptions
from tts_service.engine.prefill import PendingJoin, PrefillJob, join_groups
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import (
    OBSERVE_TAIL,
    Deferred,
    DeferredObservations,
    DraftContext,
    Drafter,
    draft_all,
)
from tts_service.engine.streams import Stream, node_uniform_block, stream_seed
from tts_service.engine.tree import DraftTree
from tts_service.engine.treepack import TreeBatch
from tts_service.engine.verify import Acceptance


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


class BatchDecoder:
    """The rows decoding now, their shared KV cache, and the per-forward counters.

    `options`: how it runs (`engine.options.DecoderOptions`), resolved against the model's
    device once (`self.options`). `cache`: one of the caller's (a tensor-parallel leader's
    mirrors its rewrites to the other ranks, `engine.tp`). The captured acceptance
    (`options.graph_acceptance`) is `graphs.GraphedAcceptance` on CUDA, reading the captured
    forward's logits in place, and on a CPU `graphs.EagerReplayedAcceptance`, the same path run
    eagerly."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        options: DecoderOptions = DEFAULTS,
        cache: StaticKV | None = None,
    ) -> None:
        self.model = model
        self.options = opts = options.resolved(model.device)
        if opts.grouped_attention:
            use_grouped_attention(model)
        # the prompts' prefilled KV, kept for rows that join later (none where the cache is
        # mirrored: a tensor-parallel follower prefills beside its leader)
        self.prompts = (
            PromptCache(max_bytes=prompt_cache_bytes(model.device)) if opts.prompt_cache else None
        )
        self.eos_ids = list(eos_ids)
        self.decode = decode
        self.min = torch.finfo(model.dtype).min
        # attend: 0, blocked: `min` (an additive mask in the model's dtype), one op a step
        self.zero = torch.zeros((), dtype=model.dtype, device=model.device)
        self.active: list[Row] = []
        self.pending: list[PendingJoin[Row]] = []  # rows admitted and their prefill jobs
        self.prefill_s_per_token: float | None = None  # the last chunk's, measured
        self.prefill_limit: int = opts.prefill_chunk or 1
        self.cache = cache if cache is not None else StaticKV(model)
        self.graphs = GraphedForward(model, self.cache) if opts.cuda_graphs else None
        self.cache.full_view = opts.full_view
        captured: GraphedAcceptance | None = None
        if opts.graph_acceptance and model.device.type != "cuda":
            captured = EagerReplayedAcceptance(model.device)
        elif opts.graph_acceptance and opts.cuda_graphs:  # reads the forward's logits in place
            captured = GraphedAcceptance(model.device)
        self.acceptance = StepAcceptance(model.device, self.graphs, captured)
        self.forwards = ForwardStats()
        self.phases = StepPhases()
        self.deferred = DeferredObservations()  # run during the next forward

    @property
    def accept_graphs(self) -> GraphedAcceptance | None:
        """The step's captured acceptance (None: eager), chosen when the decoder is built."""
        return self.acceptance.captured

    @accept_graphs.setter
    def accept_graphs(self, captured: GraphedAcceptance | None) -> None:
        self.acceptance.captured = captured

    @property
    def joining(self) -> list[Row]:
        """Rows admitted whose prompts are still prefilling (`admit`)."""
        return [row for group in self.pending for row in group.rows]

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

    def join(self, rows: list[Row]) -> None:
        """Add rows now: `admit` them and `prefill` every prompt waiting to the end."""
        self.admit(rows)
        self.prefill()

    def admit(self, rows: list[Row]) -> None:
        """Queue rows to join: each distinct prompt of theirs (all but the root) is taken from
        the prompt cache or prefilled by `prefill`, a bounded chunk at a time, and the rows join
        the batch when theirs are done (`engine.prefill`). Until then they are `joining`."""
        t0 = time.perf_counter()
        prompts = [tuple(r.tokens[:-1]) for r in rows]
        running = {p: g for g in self.pending for p in g.prompts}  # prompts prefilling now
        for i in [i for i, p in enumerate(prompts) if p in running]:
            running[prompts[i]].rows.append(rows[i])  # they join when that prompt is done
        fresh = [i for i, p in enumerate(prompts) if p not in running]
        for group in join_groups([prompts[i] for i in fresh], self.prefill_limit):
            unique = list(dict.fromkeys(prompts[fresh[i]] for i in group))
            cached = {} if self.prompts is None else {p: self.prompts.get(p) for p in unique}
            entries = {p: e for p, e in cached.items() if e is not None}
            missing = [p for p in unique if p not in entries]
            job = PrefillJob.of(missing, self.model, self.cache.shards) if any(missing) else None
            if job is None:  # nothing to run: empty prompts have no keys
                entries |= {p: [] for p in missing}
            group_rows = [rows[fresh[i]] for i in group]
            self.pending.append(PendingJoin(group_rows, unique, entries, job))
        for row in rows:
            row.joined_at = t0

    @torch.inference_mode()
    def prefill(self, tokens: int | None = None) -> list[Row]:
        """Run at most about `tokens` tokens of the waiting prompts' prefill (None: all of
        it), the job with the fewest left first; rows whose prompts are done join the batch.
        Returns the rows that joined."""
        t0, joined, limit = time.perf_counter(), [], self.prefill_limit
        while self.pending:
            group = min(self.pending, key=lambda g: g.remaining)
            job = group.job
            if job is not None and not job.finished:
                if tokens is not None and tokens <= 0:
                    break
                c0 = time.perf_counter()
                ran = job.advance(self.model, limit if tokens is None else tokens)
                sync_device(self.device)
                self.prefill_s_per_token = (time.perf_counter() - c0) / ran
                tokens = None if tokens is None else tokens - ran
                continue
            self.pending.remove(group)
            self._complete(group)
            joined += group.rows
        self.forwards.prefill_s += time.perf_counter() - t0
        return joined

    def _complete(self, group: PendingJoin[Row]) -> None:
        """The group's prompts are all prefilled: its rows join the batch below the others."""
        entries, job = dict(group.entries), group.job
        index = {p: i for i, p in enumerate(group.prompts)}
        source = [index[tuple(r.tokens[:-1])] for r in group.rows]
        rows = None if source == list(range(len(group.prompts))) else torch.tensor(source)
        kept = self.prompts is not None or bool(entries)  # entries needed apart from the job
        fresh = {p: job.entry(i) for i, p in enumerate(job.prompts)} if job and kept else {}
        if self.prompts is not None:
            for p, e in fresh.items():
                self.prompts.put(p, e)
        if job is not None and not entries:  # every prompt prefilled here: its cache, uncopied
            self.cache.append_rows(job.cache, job.valid, rows)
        else:
            entries |= fresh
            prefilled = padded_rows(group.prompts, [entries[p] for p in group.prompts])
            self.cache.append_rows(prefilled, prefilled.valid, rows)
        for row in group.rows:
            row.drafter.start(row.tokens)
        self.active.extend(group.rows)
        if job is not None and job.width > self.prefill_limit:  # its chunks' work is free now
            trim_host_memory(self.device)

    @torch.inference_mode()
    def drop(self, rows: list[Row]) -> None:
        """Take active rows out of the batch (cancelled from outside: early stop, disconnect)."""
        if not rows:
            return
        gone = {id(r) for r in rows}
        self._forget_joining(gone)
        self.flush_observations()
        keep = [b for b, r in enumerate(self.active) if id(r) not in gone]
        if len(keep) < len(self.active):
            self._keep_rows(keep)

    def _forget_joining(self, gone: set[int]) -> None:
        """Rows `gone` (ids) no longer wait to join; a job no row waits for is dropped."""
        for group in list(self.pending):
            group.rows = [r for r in group.rows if id(r) not in gone]
            if not group.rows:
                self.pending.remove(group)
                if group.job is not None:
                    self.cache.discard_prefill(group.job.cache)
                    trim_host_memory(self.device)

    def reset(self) -> None:
        """Drop every row, those joining included, and the KV rows a failed join had appended
        with no row to drop."""
        self.drop(list(self.active) + list(self.joining))
        self.cache.clear()

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:  # an empty batch starts over at slot 0
            self.active = []
            self.cache.clear()
        else:
            order = fill_holes(keep)
            self.cache.select_rows(order)
            self.active = [self.active[b] for b in order]
        self._give_back()

    def _give_back(self) -> None:
        """Shrink the cache to what the rows use and return the memory to the system, where it
        holds far more (a long row left, `StaticKV.shrink`)."""
        if self.cache.shrink():
            trim_host_memory(self.device)

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
        before = [len(r.tokens) for r in batch] if max_nodes == 0 else None  # roots' contexts
        timer = self.phases.timer()
        trees = self._draft(batch, max_nodes, fill)  # 1. draft, one tree per row
        timer.mark("draft")
        start, width = self.cache.length, max(t.size for t in trees)
        tb, static, inputs = self._pack_step(batch, trees, width)  # 2. pack
        timer.mark("pack")
        logits = self._forward(*inputs, start)  # 3. one forward for the whole batch: [R, N, V]
        timer.mark("forward")
        self._in_forwards_shadow()
        timer.mark("overlap")
        if static is None:
            logits = logits[: len(batch), :width]
        verified = self.verify(batch, trees, logits, tb, static)  # 4. one copy back
        timer.mark("verify")
        keeps, committed = self._accept(batch, trees, verified)  # 5. commit
        timer.mark("accept")
        finished = self._keep(start, keeps)  # 6. each row keeps root + accepted path
        timer.mark("kv")
        self._observe(batch, trees, verified, before, observe)  # 7. the drafters learn
        if not self.active or not self.options.defer_observation:  # no forward to hide it under
            self.flush_observations()
        timer.mark("observe")
        self._book(batch, trees, finished, timer, (width, committed, start))
        return finished

    def _in_forwards_shadow(self) -> None:
        """What runs while the device computes the forward: the last step's deferred
        observation and the collector's pass."""
        self.flush_observations()
        collect_in_shadow()

    def _pack_step(
        self, batch: list[Row], trees: list[DraftTree], width: int
    ) -> tuple[TreeBatch, StepInputs | None, tuple[torch.Tensor, ...]]:
        """The step's trees as the forward's inputs (ids, positions, mask) at its shape; where
        the acceptance is captured, written to the bucket's captured inputs (`static`), the
        sampled rows' uniforms with them, copied while the device is still free."""
        shape = self._shape(len(batch), width)
        self.cache.reserve(shape[0], self.cache.length + shape[1])
        static = self.accept_graphs.inputs(*shape) if self.accept_graphs is not None else None
        roots = [len(r.tokens) - 1 for r in batch]
        if static is None:
            tb = TreeBatch.of(trees, width, self.device, roots)
        else:  # the whole bucket, pad rows included
            pad = shape[0] - len(trees)
            trees_b, roots_b = trees + [DraftTree.root_only(0)] * pad, roots + [0] * pad
            uniforms = None
            if not all(r.cfg.greedy for r in batch):
                uniforms = node_uniform_block(*verify_streams(batch, pad), shape[1])
            tb = static.fill(trees_b, roots_b, uniforms)
        return tb, static, self._pack(tb, shape)

    def _book(
        self,
        batch: list[Row],
        trees: list[DraftTree],
        finished: list[Row],
        timer: StepTimer,
        step: tuple[int, int, int],
    ) -> None:
        """The step's phases, each row's share of its time, finished rows' latency, and the
        forward's record (`step`: its width, tokens committed and start slot)."""
        self.phases.record(timer)
        draft, observe = timer.seconds("draft"), timer.seconds("observe")
        forward = timer.total() - draft - observe  # pack to KV: the forward and its acceptance
        for row in batch:  # one forward for all: each row is booked an equal share
            row.stats.draft_s += (draft + observe) / len(batch)
            row.stats.verify_s += forward / len(batch)
        for row in finished:
            row.stats.wall_s = timer.end - row.joined_at  # the row's own latency, join to finish
        width, committed, start = step
        nodes = sum(t.size - 1 for t in trees)
        self.forwards.record(len(batch), width, nodes, committed, draft, forward, observe, start)

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
        if self.active and self.cache.length > 2 * entries + self.options.compact_slack:
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
        """Every row's acceptance and top-k from `logits` (`engine.acceptance`); timing replay
        overrides it (acceptance that follows a log, `tts_service.replay`)."""
        return self.acceptance(batch, trees, logits, tb, static)

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
        self.active = []
        self.cache.fill_random(rows, context_len, seed)

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
        self.cache.truncate(start)
        return seconds

    def _compact(self) -> None:
        """Right-align every row's valid slots and drop the holes (a stable sort puts each
        row's holes first, its slots after them in order)."""
        valid = self.cache.active_valid()
        width = int(valid.sum(1).max())
        order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices
        self.cache.gather_slots(order[:, -width:].contiguous(), valid.gather(1, order[:, -width:]))
        self._give_back()
