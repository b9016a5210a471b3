"""Plain decoding, the oracle every speculative path is tested against, and what decoding
shares: the stop rule, the result, and the top-k handed to drafters.

`plain_generate` is transformers' own loop over a `DynamicCache`, one forward per token, kept
independent of the speculative engine (`engine.batch`) on purpose: it is the reference.
Speculative invariant: the KV cache holds every committed token except the last one, the
**root**, which is the first input of the next verify forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel

from tts_service.engine.metrics import GenerationStats
from tts_service.engine.sampling import SamplingParams, target_probs
from tts_service.engine.streams import Stream, node_uniforms, stream_seed
from tts_service.engine.treebatch import residual_bonus

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


@dataclass(frozen=True)
class GenerationOutput:
    """A finished generation as the edges report it: the result with its text (cut before
    the stop string that ended it)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


class StopRule:
    """Appends tokens one at a time and says when plain decoding would have stopped.

    Shared by both decoders so that EOS, `max_new_tokens` and stop strings cut an accepted
    block exactly where plain decoding stops.
    """

    def __init__(
        self,
        cfg: SamplingParams,
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


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def plain_generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    cfg: SamplingParams,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
    on_commit: OnCommit | None = None,
) -> GenerationResult:
    """Reference autoregressive decoding with a KV cache: one forward per token."""
    start = time.perf_counter()
    cfg = SamplingParams.of(cfg)
    key = stream_seed(cfg.seed, Stream.VERIFY, cfg.salt)
    rule, stats = StopRule(cfg, eos_ids, decode, on_commit), GenerationStats()
    cache = _new_cache(model)
    ids = torch.tensor([list(prompt_ids)], device=model.device)
    while rule.finish is None:
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0]
        if cfg.greedy:
            token = int(logits[0].argmax())
        else:
            # the engine's draw at a root with no children, at the root's counter
            _, v, _ = node_uniforms([key], [len(prompt_ids) + len(rule.out)], 1, model.device)
            token = int(residual_bonus(target_probs(logits, cfg)[None], v)[0, 0])
        rule.push([token])
        stats.record_step(0, 0, 1)
        ids = torch.tensor([[token]], device=model.device)
    stats.wall_s = stats.verify_s = time.perf_counter() - start
    return GenerationResult(tuple(rule.out), rule.finish, stats, rule.stop_text)
