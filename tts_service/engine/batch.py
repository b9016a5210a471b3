"""Continuous batched speculative decoding: rows decode together, each with its own draft tree,
in one target forward per step; rows join a running batch and leave it when they finish.

One KV cache holds the batch. A row's valid entries need not be contiguous: a row that joins is
prefilled on its own and spliced in left padded, and after each step a row keeps only its root
and accepted nodes at the front of the step's new region; the rest of that region becomes a
hole. `valid[b, s]` says which cache slots row b may attend to, and positions are logical
(prefix length + depth), so holes change nothing a row computes. When holes outnumber entries
the cache is compacted. Every row commits exactly what it would alone (greedy: the same tokens;
sampling: the same distribution, from the row's own random stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.config import SamplingConfig
from tts_service.drafters.base import DraftContext, Drafter
from tts_service.engine.decode import GenerationResult, OnCommit, StopRule, store_topk
from tts_service.engine.kv import append_rows, gather_slots, keep_region, select_rows
from tts_service.engine.metrics import ForwardStats, GenerationStats
from tts_service.engine.sampling import target_probs
from tts_service.engine.streams import Stream, stream_generator
from tts_service.engine.tree import DraftTree, ancestor_mask
from tts_service.engine.verify import Acceptance, verify_greedy, verify_sampling


@dataclass
class Row:
    """One trajectory in the batch. `tag` is the caller's handle (the runner's request)."""

    prompt_ids: list[int]
    drafter: Drafter
    cfg: SamplingConfig
    rule: StopRule
    device: torch.device  # the verifier's random stream lives where the target's logits do
    tag: Any = None
    tokens: list[int] = field(init=False)
    gen: torch.Generator = field(init=False)
    stats: GenerationStats = field(default_factory=GenerationStats)
    joined_at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.gen = stream_generator(self.cfg.seed, Stream.VERIFY, self.device)

    def result(self) -> GenerationResult:
        return GenerationResult(
            tuple(self.rule.out), self.rule.finish, self.stats, self.rule.stop_text
        )


StepObserver = Callable[[Row, DraftTree, Acceptance], None]


def nodes_per_row(token_budget: int, active_rows: int) -> int:
    """Draft nodes each row may send: a fixed token budget shared out, root included."""
    return max(0, token_budget // max(active_rows, 1) - 1)


class BatchDecoder:
    """The rows decoding now, their shared KV cache, and the per-forward counters."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        compact_slack: int = 64,
    ) -> None:
        self.model = model
        self.compact_slack = compact_slack
        self.eos_ids = list(eos_ids)
        self.decode = decode
        self.min = torch.finfo(model.dtype).min
        self.active: list[Row] = []
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=model.device)
        self.forwards = ForwardStats()

    def new_row(
        self,
        prompt_ids: list[int],
        drafter: Drafter,
        cfg: SamplingConfig,
        on_commit: OnCommit | None = None,
        tag: Any = None,
    ) -> Row:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        rule = StopRule(cfg, self.eos_ids, self.decode, on_commit)
        return Row(list(prompt_ids), drafter, cfg, rule, self.model.device, tag)

    @torch.inference_mode()
    def run(self, rows: list[Row], token_budget: int = 64) -> list[GenerationResult]:
        """Decode `rows` to completion together, `token_budget` tokens per forward."""
        self.join(rows)
        while self.active:
            self.step(nodes_per_row(token_budget, len(self.active)))
        return [r.result() for r in rows]

    @torch.inference_mode()
    def join(self, rows: list[Row]) -> None:
        """Prefill the rows' prompts (all but the root) in one forward and add them."""
        t0 = time.perf_counter()
        cache, valid = self._prefill(rows)
        self.valid = append_rows(self.cache, self.valid, cache, valid)
        for row in rows:
            row.drafter.start(row.tokens)
            row.joined_at = t0
        self.active.extend(rows)
        self.forwards.prefill_s += time.perf_counter() - t0

    def drop(self, rows: list[Row]) -> None:
        """Take active rows out of the batch (cancelled from outside: early stop, disconnect)."""
        gone = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.active) if id(r) not in gone]
        if len(keep) < len(self.active):
            self._keep_rows(keep)

    def _keep_rows(self, keep: list[int]) -> None:
        if not keep:  # an empty batch starts over with an empty cache
            self.active, self.cache = [], DynamicCache(config=self.model.config)
            self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.model.device)
            return
        sel = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        select_rows(self.cache, sel)
        self.valid = self.valid.index_select(0, sel)
        self.active = [self.active[b] for b in keep]

    def _prefill(self, rows: list[Row]) -> tuple[DynamicCache, torch.Tensor]:
        """Left-padded prefill of every prompt but its root, into a cache of their own."""
        device = self.model.device
        lengths = [len(r.tokens) - 1 for r in rows]
        width = max(lengths)
        cache = DynamicCache(config=self.model.config)
        valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
        if width == 0:
            return cache, valid
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        pos = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            if n:
                ids[b, width - n :] = torch.tensor(row.tokens[:-1], device=device)
                pos[b, width - n :] = torch.arange(n, device=device)
                valid[b, width - n :] = True
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(
            width, dtype=torch.bool, device=device
        )[None]
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=device)
        mask.masked_fill_(~allowed, self.min)
        self.model(
            ids,
            attention_mask=mask[:, None],
            position_ids=pos,
            past_key_values=cache,
            logits_to_keep=1,
        )
        return cache, valid

    def _pack(self, trees: list[DraftTree], roots: list[int], valid: torch.Tensor):
        """Batched inputs: `[B, n]` ids and positions, `[B, 1, n, S + n]` mask."""
        device = self.model.device
        b_size, n = len(trees), max(t.size for t in trees)
        ids = torch.zeros(b_size, n, dtype=torch.long)
        pos = torch.zeros(b_size, n, dtype=torch.long)
        tree_allowed = torch.eye(n, dtype=torch.bool).repeat(b_size, 1, 1)  # pads: self only
        for b, (tree, root_pos) in enumerate(zip(trees, roots, strict=True)):
            ids[b, : tree.size] = torch.tensor(tree.tokens)
            ids[b, tree.size :] = tree.tokens[0]
            pos[b, : tree.size] = torch.tensor(tree.depths) + root_pos
            pos[b, tree.size :] = root_pos
            tree_allowed[b, : tree.size, : tree.size] = ancestor_mask(tree.parents)
        allowed = torch.cat([valid[:, None, :].expand(-1, n, -1).cpu(), tree_allowed], dim=2)
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype)
        mask.masked_fill_(~allowed, self.min)
        return ids.to(device), pos.to(device), mask[:, None].to(device)

    @torch.inference_mode()
    def step(self, max_nodes: int, observe: StepObserver | None = None) -> list[Row]:
        """One forward for every active row, each drafting at most `max_nodes` nodes;
        `observe` sees every row's tree and acceptance (the allocator's statistics).

        Returns the rows that finished (they have left the batch)."""
        batch = self.active
        # 1. draft, one tree per row
        t0 = time.perf_counter()
        trees = [
            r.drafter.draft(DraftContext(r.tokens, len(r.prompt_ids), max_nodes, r.cfg.greedy))
            for r in batch
        ]
        t1 = time.perf_counter()
        # 2-3. pack and one forward for the whole batch
        prefix = self.cache.get_seq_length()
        ids, pos, mask = self._pack(trees, [len(r.tokens) - 1 for r in batch], self.valid)
        logits = self._forward(ids, pos, mask, self.cache)  # [B, n, V]
        # 4-5. verify and accept, row by row
        keeps, accs, still, done, committed_total = [], [], [], [], 0
        for b, (row, tree) in enumerate(zip(batch, trees, strict=True)):
            row_logits = logits[b, : tree.size]
            acc = (
                verify_greedy(tree, row_logits)
                if row.cfg.greedy
                else verify_sampling(tree, target_probs(row_logits, row.cfg), row.gen)
            )
            committed = row.rule.push(acc.committed)
            committed_total += committed
            row.tokens.extend(acc.committed[:committed])
            keeps.append([0, *acc.path])
            accs.append(acc)
            row.stats.record_step(tree.size - 1, min(acc.num_accepted, committed), committed)
            (still if row.rule.finish is None else done).append(b)
        # 6. compact KV: each row keeps root + accepted path at the front of the new region
        m = max(len(k) for k in keeps)
        idx = torch.zeros(len(batch), m, dtype=torch.long)
        new_valid = torch.zeros(len(batch), m, dtype=torch.bool)
        for b, keep in enumerate(keeps):
            idx[b, : len(keep)] = torch.tensor(keep)
            new_valid[b, : len(keep)] = True
        keep_region(self.cache, prefix, idx.to(self.valid.device))
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)
        finished = [batch[b] for b in done]
        if done:  # finished rows leave the batch
            self._keep_rows(still)
        if self.active and self.valid.shape[1] > 2 * int(self.valid.sum(1).max()) + (
            self.compact_slack
        ):
            self.valid = self._compact(self.cache, self.valid)
        t2 = time.perf_counter()
        # 7. observe: every drafter learns from the target's distributions at its nodes
        for b, (row, tree, acc) in enumerate(zip(batch, trees, accs, strict=True)):
            row.drafter.observe(tree, acc, store_topk(logits[b, : tree.size], row.cfg))
            if observe is not None:
                observe(row, tree, acc)
        t3 = time.perf_counter()
        for row in batch:  # one forward for all: each row is booked an equal share
            row.stats.draft_s += ((t1 - t0) + (t3 - t2)) / len(batch)
            row.stats.verify_s += (t2 - t1) / len(batch)
        for row in finished:
            row.stats.wall_s = t3 - row.joined_at  # the row's own latency, join to finish
        nodes = sum(t.size - 1 for t in trees)
        self.forwards.record(
            len(batch), ids.shape[1], nodes, committed_total, (t1 - t0) + (t3 - t2), t2 - t1
        )
        return finished

    def _forward(self, ids, pos, mask, cache: DynamicCache) -> torch.Tensor:
        out = self.model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
        return out.logits

    @staticmethod
    def _compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
        """Right-align every row's valid slots and drop the holes."""
        counts = valid.sum(1)
        width = int(counts.max())
        idx = torch.zeros(valid.shape[0], width, dtype=torch.long, device=valid.device)
        new_valid = torch.zeros(valid.shape[0], width, dtype=torch.bool, device=valid.device)
        for b in range(valid.shape[0]):
            slots = torch.nonzero(valid[b]).flatten()
            idx[b, width - len(slots) :] = slots
            new_valid[b, width - len(slots) :] = True
        gather_slots(cache, idx)
        return new_valid
