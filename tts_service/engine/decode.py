"""Plain decoding (the oracle and the baseline) and speculative tree decoding, side by side.

Speculative invariant: the KV cache holds every committed token except the last one, the
**root**, which is the first input of the next verify forward. One step is:
draft -> pack -> forward -> verify -> accept -> compact KV -> observe.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.config import SamplingConfig
from tts_service.drafters.base import DraftContext, Drafter, NodeTopK
from tts_service.engine.kv import keep_kv
from tts_service.engine.metrics import GenerationStats
from tts_service.engine.sampling import sample, store_probs, target_probs
from tts_service.engine.streams import Stream, stream_generator
from tts_service.engine.tree import pack
from tts_service.engine.verify import Acceptance, verify_greedy, verify_sampling

FinishReason = Literal["stop", "length", "cancelled"]
OnCommit = Callable[[Sequence[int]], bool]
"""Sees each step's committed tokens; returning False cancels the generation."""
STORE_TOPK = 10
"""Target ids per node handed to drafters (at most the vocabulary)."""


@dataclass(frozen=True)
class GenerationResult:
    token_ids: tuple[int, ...]  # generated tokens only
    finish_reason: FinishReason
    stats: GenerationStats
    stop_text: str | None = None  # the stop string that ended generation, if any


class StopRule:
    """Appends tokens one at a time and says when plain decoding would have stopped.

    Shared by both decoders so that EOS, `max_new_tokens` and stop strings cut an accepted
    block exactly where plain decoding stops.
    """

    def __init__(
        self,
        cfg: SamplingConfig,
        eos_ids: Sequence[int],
        decode: Callable[[list[int]], str] | None = None,
        on_commit: OnCommit | None = None,
    ) -> None:
        if cfg.stop and decode is None:
            raise ValueError("stop strings need a tokenizer decode function")
        self.max_new = cfg.max_new_tokens
        self.eos = frozenset(() if cfg.ignore_eos else eos_ids)
        self.stops = cfg.stop
        self.decode = decode
        self.window = max((len(s) for s in cfg.stop), default=0) + 16
        self.on_commit = on_commit
        self.out: list[int] = []
        self.finish: FinishReason | None = None
        self.stop_text: str | None = None

    def push(self, tokens: Sequence[int]) -> int:
        """Append tokens until a stop; return how many were appended."""
        n = self._append(tokens)
        if self.on_commit is not None and not self.on_commit(tokens[:n]) and self.finish is None:
            self.finish = "cancelled"
        return n

    def _append(self, tokens: Sequence[int]) -> int:
        for i, t in enumerate(tokens):
            self.out.append(t)
            if t in self.eos:
                self.finish = "stop"
            elif self.stops:
                tail = self.decode(self.out[-self.window :])
                self.stop_text = next((s for s in self.stops if s in tail), None)
                if self.stop_text is not None:
                    self.finish = "stop"
            if self.finish is None and len(self.out) >= self.max_new:
                self.finish = "length"
            if self.finish is not None:
                return i + 1
        return len(tokens)


def store_topk(logits: torch.Tensor, cfg: SamplingConfig) -> NodeTopK:
    """The target's top ids and probabilities at every node, on the CPU, for the drafters."""
    top = torch.topk(store_probs(logits, cfg), min(STORE_TOPK, logits.shape[-1]), dim=-1)
    return NodeTopK(top.indices.cpu(), top.values.cpu())


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def plain_generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    cfg: SamplingConfig,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
    on_commit: OnCommit | None = None,
) -> GenerationResult:
    """Reference autoregressive decoding with a KV cache: one forward per token."""
    start = time.perf_counter()
    gen = stream_generator(cfg.seed, Stream.VERIFY, model.device)
    rule, stats = StopRule(cfg, eos_ids, decode, on_commit), GenerationStats()
    cache = _new_cache(model)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    while rule.finish is None:
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0]
        if cfg.greedy:
            token = int(logits[0].argmax())
        else:
            token = sample(target_probs(logits, cfg)[0], gen)
        rule.push([token])
        stats.record_step(0, 0, 1)
        ids = torch.tensor([[token]], device=model.device)
    stats.wall_s = stats.verify_s = time.perf_counter() - start
    return GenerationResult(tuple(rule.out), rule.finish, stats, rule.stop_text)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    cfg: SamplingConfig,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
    max_nodes: int = 1024,
    on_commit: OnCommit | None = None,
) -> GenerationResult:
    """Speculative tree decoding; commits exactly what `plain_generate` would (greedy), or the
    same distribution (sampling)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    start = time.perf_counter()
    gen = stream_generator(cfg.seed, Stream.VERIFY, model.device)
    rule, stats = StopRule(cfg, eos_ids, decode, on_commit), GenerationStats()
    cache = _new_cache(model)
    tokens = list(prompt_ids)
    if len(tokens) > 1:  # prefill everything but the root
        prefix = torch.tensor([tokens[:-1]], device=model.device)
        model(prefix, past_key_values=cache, logits_to_keep=1)
    drafter.start(tokens)
    while rule.finish is None:
        step(model, cache, drafter, tokens, len(prompt_ids), cfg, gen, rule, stats, max_nodes)
    stats.wall_s = time.perf_counter() - start
    return GenerationResult(tuple(rule.out), rule.finish, stats, rule.stop_text)


def step(
    model: PreTrainedModel,
    cache: DynamicCache,
    drafter: Drafter,
    tokens: list[int],
    prompt_len: int,
    cfg: SamplingConfig,
    gen: torch.Generator,
    rule: StopRule,
    stats: GenerationStats,
    max_nodes: int,
) -> Acceptance:
    """One speculative step; appends the committed tokens to `tokens` and `rule`."""
    # 1. draft
    t0 = time.perf_counter()
    tree = drafter.draft(DraftContext(tokens, prompt_len, max_nodes, cfg.greedy))
    t1 = time.perf_counter()
    # 2. pack: root + draft nodes, positions prefix_len + depth, ancestor-only mask
    prefix_len = cache.get_seq_length()
    ids, pos, mask = pack(tree, prefix_len, model.dtype, model.device)
    # 3. forward: one target pass over the whole tree
    logits = model(
        ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
    ).logits[0]  # [n, V]
    # 4. verify
    if cfg.greedy:
        acc = verify_greedy(tree, logits)
    else:
        acc = verify_sampling(tree, target_probs(logits, cfg), gen)
    # 5. accept: EOS / max tokens / stop strings may cut the block
    num_committed = rule.push(acc.committed)
    tokens.extend(acc.committed[:num_committed])
    # 6. compact KV: keep the root and the accepted path
    keep_kv(cache, prefix_len, [0, *acc.path])
    t2 = time.perf_counter()
    # 7. observe: the drafter learns from the target's distributions at every node
    top = store_topk(logits, cfg)
    drafter.observe(tree, acc, top)
    t3 = time.perf_counter()
    stats.record_step(tree.size - 1, min(acc.num_accepted, num_committed), num_committed)
    stats.draft_s += (t1 - t0) + (t3 - t2)
    stats.verify_s += t2 - t1
    return acc
