"""Batched speculative decoding: B trajectories decode together, each row with its own draft
tree, in one target forward per step.

One KV cache holds the batch. A row's valid entries need not be contiguous: prompts are left
padded, and after each step a row keeps only its root and accepted nodes at the front of the
step's new region; the rest of that region becomes a hole. `valid[b, s]` says which cache
slots row b may attend to, and positions are logical (prefix length + depth), so holes change
nothing a row computes. When holes outnumber entries the cache is compacted. A finished row
leaves the batch. Every row commits exactly what it would alone (greedy: the same tokens;
sampling: the same distribution, from the row's own random stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.config import SamplingConfig
from tts_service.drafters.base import DraftContext, Drafter
from tts_service.engine.decode import GenerationResult, OnCommit, StopRule, store_topk
from tts_service.engine.kv import gather_slots, keep_region, select_rows
from tts_service.engine.metrics import GenerationStats
from tts_service.engine.sampling import target_probs
from tts_service.engine.streams import Stream, stream_generator
from tts_service.engine.tree import DraftTree, ancestor_mask
from tts_service.engine.verify import verify_greedy, verify_sampling


@dataclass
class Row:
    """One trajectory in the batch."""

    prompt_ids: list[int]
    drafter: Drafter
    cfg: SamplingConfig
    rule: StopRule
    device: torch.device  # the verifier's random stream lives where the target's logits do
    tokens: list[int] = field(init=False)
    gen: torch.Generator = field(init=False)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.gen = stream_generator(self.cfg.seed, Stream.VERIFY, self.device)


def nodes_per_row(token_budget: int, active_rows: int) -> int:
    """Draft nodes each row may send: the step's token budget shared out, root included."""
    return max(0, token_budget // max(active_rows, 1) - 1)


class BatchDecoder:
    """Decodes a list of rows to completion. `token_budget` caps tokens per forward."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        token_budget: int = 64,
        compact_slack: int = 64,
    ) -> None:
        self.model = model
        self.compact_slack = compact_slack
        self.eos_ids = list(eos_ids)
        self.decode = decode
        self.token_budget = token_budget
        self.min = torch.finfo(model.dtype).min

    def rows(
        self,
        prompts: Sequence[list[int]],
        drafters: Sequence[Drafter],
        cfgs: Sequence[SamplingConfig],
        on_commit: OnCommit | None = None,
    ) -> list[Row]:
        return [
            Row(list(p), d, c, StopRule(c, self.eos_ids, self.decode, on_commit), self.model.device)
            for p, d, c in zip(prompts, drafters, cfgs, strict=True)
        ]

    @torch.inference_mode()
    def run(self, rows: list[Row]) -> list[GenerationResult]:
        start = time.perf_counter()
        cache, valid = self._prefill(rows)
        for row in rows:
            row.drafter.start(row.tokens)
        active = list(range(len(rows)))
        while active:
            cache, valid, active = self._step(rows, active, cache, valid)
        wall = time.perf_counter() - start
        for row in rows:
            row.stats.wall_s = wall  # rows share the batch's wall time
        return [
            GenerationResult(tuple(r.rule.out), r.rule.finish, r.stats, r.rule.stop_text)
            for r in rows
        ]

    def _prefill(self, rows: list[Row]) -> tuple[DynamicCache, torch.Tensor]:
        """Left-padded prefill of every prompt but its root."""
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

    def _step(self, rows: list[Row], active: list[int], cache: DynamicCache, valid: torch.Tensor):
        batch = [rows[i] for i in active]
        budget = nodes_per_row(self.token_budget, len(batch))
        # 1. draft, one tree per row
        t0 = time.perf_counter()
        trees = [
            r.drafter.draft(DraftContext(r.tokens, len(r.prompt_ids), budget, r.cfg.greedy))
            for r in batch
        ]
        t1 = time.perf_counter()
        # 2-3. pack and one forward for the whole batch
        prefix = cache.get_seq_length()
        ids, pos, mask = self._pack(trees, [len(r.tokens) - 1 for r in batch], valid)
        logits = self._forward(ids, pos, mask, cache)  # [B, n, V]
        # 4-5. verify and accept, row by row
        keeps, still = [], []
        for b, (row, tree) in enumerate(zip(batch, trees, strict=True)):
            row_logits = logits[b, : tree.size]
            acc = (
                verify_greedy(tree, row_logits)
                if row.cfg.greedy
                else verify_sampling(tree, target_probs(row_logits, row.cfg), row.gen)
            )
            committed = row.rule.push(acc.committed)
            row.tokens.extend(acc.committed[:committed])
            keeps.append([0, *acc.path])
            row.stats.record_step(tree.size - 1, min(acc.num_accepted, committed), committed)
            # 7. observe now, so the next row's drafting already sees this row's distributions
            row.drafter.observe(tree, acc, store_topk(row_logits, row.cfg))
            if row.rule.finish is None:
                still.append(b)
        # 6. compact KV: each row keeps root + accepted path at the front of the new region
        m = max(len(k) for k in keeps)
        idx = torch.zeros(len(batch), m, dtype=torch.long)
        new_valid = torch.zeros(len(batch), m, dtype=torch.bool)
        for b, keep in enumerate(keeps):
            idx[b, : len(keep)] = torch.tensor(keep)
            new_valid[b, : len(keep)] = True
        keep_region(cache, prefix, idx.to(valid.device))
        valid = torch.cat([valid, new_valid.to(valid.device)], dim=1)
        if len(still) < len(batch):  # finished rows leave the batch
            sel = torch.tensor(still, dtype=torch.long, device=valid.device)
            select_rows(cache, sel)
            valid = valid.index_select(0, sel)
        if still and valid.shape[1] > 2 * int(valid.sum(1).max()) + self.compact_slack:
            valid = self._compact(cache, valid)
        t3 = time.perf_counter()
        for row in batch:
            row.stats.draft_s += (t1 - t0) / len(batch)
            row.stats.verify_s += (t3 - t1) / len(batch)
        return cache, valid, [active[b] for b in still]

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
