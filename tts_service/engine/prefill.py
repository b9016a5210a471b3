"""Prompts prefilled in bounded chunks, interleaved with the batch's steps.

A prompt is prefilled a chunk of positions at a time into a cache of its own, so no forward
costs more than its chunk: a long prompt never stalls the rows already decoding (the decoder
runs one chunk between two of their steps, `BatchDecoder.prefill`) and never holds more than
its chunk's work area (vLLM's and SGLang's chunked prefill, `max_num_batched_tokens`). Each
chunk attends under a `[rows, 1, chunk, context]` additive mask in the model's dtype: its
size is the chunk times the keys it reads, never the prompt's square.

Distinct prompts that join together are prefilled together, left padded to one width
(`PrefillJob`); one job runs at a time, the job with the fewest positions left first, so a
short prompt that arrives while a long one is prefilling joins at the next step. The chunk's
size is the caller's (`chunk_tokens`): the whole budget while no row decodes, else as many
positions as cost about one of the batch's steps, so the decoding rows' steps take at most
about twice as long while a long prompt is prefilled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from transformers import PreTrainedModel

from tts_service.engine.kv import LayerKV, PrefillKV

MIN_CHUNK = 32
"""The fewest positions a chunk runs (every step makes progress)."""


def max_chunk(device: torch.device) -> int:
    """The most positions one chunk runs: its work area's bound (the activations of this
    many tokens, and attention's `chunk × context` scores where the kernel materialises them)."""
    return 2048 if device.type == "cuda" else 512


def chunk_tokens(step_s: float | None, s_per_token: float | None, limit: int) -> int:
    """Positions the next chunk may run: `limit` while no row decodes (`step_s` None) or while
    the rate is unknown, else what costs about one of the batch's steps (`step_s` seconds, at
    `s_per_token` seconds a prefilled position), within `[MIN_CHUNK, limit]`."""
    if step_s is None or not s_per_token:
        return limit
    return max(MIN_CHUNK, min(limit, int(step_s / s_per_token)))


@dataclass(eq=False)
class PrefillJob:
    """Distinct prompts prefilled together, left padded to one width, `done` positions so far,
    into `cache` (allocated at the full width once)."""

    prompts: list[tuple[int, ...]]
    ids: torch.Tensor  # [rows, width] the prompts, left padded with 0
    positions: torch.Tensor  # [rows, width] each prompt's own positions from 0
    valid: torch.Tensor  # [rows, width] bool: a prompt's slot, not padding
    cache: PrefillKV
    done: int = 0
    seconds: float = 0.0  # the chunks' forwards, so far

    @classmethod
    def of(
        cls, prompts: list[tuple[int, ...]], model: PreTrainedModel, shards: int = 1
    ) -> PrefillJob:
        """The job of `prompts` over `model` (a tensor-parallel rank's shard of `shards`)."""
        device = model.device
        width = max(len(p) for p in prompts)
        shape = (len(prompts), width)
        ids = torch.zeros(shape, dtype=torch.long)
        pos = torch.zeros(shape, dtype=torch.long)
        valid = torch.zeros(shape, dtype=torch.bool)
        for b, prompt in enumerate(prompts):
            n = len(prompt)
            if n:
                ids[b, width - n :] = torch.tensor(prompt)
                pos[b, width - n :] = torch.arange(n)
                valid[b, width - n :] = True
        cache = PrefillKV(model, len(prompts), width, shards)
        return cls(prompts, ids.to(device), pos.to(device), valid.to(device), cache)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def remaining(self) -> int:
        """Tokens left to run (rows × positions)."""
        return len(self.prompts) * (self.width - self.done)

    @property
    def finished(self) -> bool:
        return self.done >= self.width

    def chunk_mask(self, end: int, dtype: torch.dtype) -> torch.Tensor:
        """`[rows, 1, end - done, end]` additive: position i of the chunk attends to the
        prompt's own earlier slots and itself (a padding position to itself alone)."""
        start, device = self.done, self.ids.device
        n = end - start
        causal = torch.ones(n, end, dtype=torch.bool, device=device).tril(start)
        allowed = causal[None] & self.valid[:, None, :end]
        diagonal = torch.arange(n, device=device)
        allowed[:, diagonal, start + diagonal] = True
        zero = torch.zeros((), dtype=dtype, device=device)
        return zero.where(allowed, torch.finfo(dtype).min)[:, None]

    def entry(self, i: int) -> list[LayerKV]:
        """Prompt i's keys and values alone, `[1, kv_heads, len, head_dim]` per layer (the
        prompt cache's form): views where the job had one prompt, copies otherwise."""
        n = len(self.prompts[i])
        if not n:
            return []
        own = len(self.prompts) == 1  # nothing else in these tensors to keep alive

        def part(t: torch.Tensor) -> torch.Tensor:
            view = t[i : i + 1, :, self.width - n :]
            return view if own else view.clone()

        return [LayerKV(part(layer.keys), part(layer.values)) for layer in self.cache.layers]

    @torch.inference_mode()
    def advance(self, model: PreTrainedModel, tokens: int) -> int:
        """Run the next chunk: as many positions as `tokens` covers over the job's rows (one at
        least); returns the tokens run."""
        columns = max(1, min(tokens // len(self.prompts), self.width - self.done))
        start, end = self.done, self.done + columns
        t0 = time.perf_counter()
        model(
            self.ids[:, start:end],
            attention_mask=self.chunk_mask(end, model.dtype),
            position_ids=self.positions[:, start:end],
            past_key_values=self.cache,
            logits_to_keep=1,
        )
        self.cache.advance(columns)
        self.done = end
        self.seconds += time.perf_counter() - t0
        return columns * len(self.prompts)


R = TypeVar("R")


@dataclass(eq=False)
class PendingJoin(Generic[R]):
    """Rows admitted together, waiting for their prompts: `prompts` (distinct, all but each
    row's root) found in the prompt cache (`entries`) or prefilled by `job`."""

    rows: list[R]
    prompts: list[tuple[int, ...]]
    entries: dict[tuple[int, ...], list[LayerKV]]
    job: PrefillJob | None

    @property
    def remaining(self) -> int:
        """Tokens left to prefill before the rows can join."""
        return 0 if self.job is None else self.job.remaining


def join_groups(prompts: list[tuple[int, ...]], limit: int) -> list[list[int]]:
    """The indices of `prompts` grouped into prefill jobs: every prompt of at most `limit`
    tokens in one job (one forward for many short prompts), each distinct longer prompt in a
    job of its own (with every index that shares it), so a long prompt never holds a short one
    back."""
    short = [i for i, p in enumerate(prompts) if len(p) <= limit]
    long: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        if len(p) > limit:
            long.setdefault(p, []).append(i)
    return ([short] if short else []) + list(long.values())
