"""CUDA graphs of the verify forward: one capture per (rows, tokens) bucket, replayed each step.

On a GPU, an eager transformers forward of a 7B model launches ~1000 kernels, and at small
batches their launch overhead, not the GPU, sets the speed. A captured graph replays them all
with one launch. Graphs need static shapes and addresses, so the batch's inputs are padded to a
bucket (rows and tokens rounded up to powers of two), copied into the graph's own input
buffers, and attention spans the whole preallocated cache (`StaticKV.full_view`) with the
write slots taken from a device tensor. Reallocating the cache (`StaticKV.epoch`) drops the
graphs; they are captured again when next needed. A capture that fails (a model whose forward
syncs with the host) turns graphs off with a warning and the eager forward runs instead.

Every bucket is captured at its first step. A capture costs about three eager forwards, and an
eager 7B forward costs about twice a graph's; capturing tree buckets only at their fourth step
ran the first three eagerly and the ones met less often eagerly for good (an H100's best-of-16
through the live runner: `auto` 596 and 608 tokens/s that way, 775 and 782 capturing at once,
plain 777 to 894 beside them). The step that captures is not its bucket's cost (`last_steady`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from tts_service.engine.kv import StaticKV

log = logging.getLogger(__name__)

MAX_TOKENS = 1024
"""The largest rows × tokens bucket captured; bigger steps run eagerly."""


def bucket_of(n: int) -> int:
    """The power of two at or above `n`."""
    return 1 << max(0, n - 1).bit_length()


def forward_at(
    model: PreTrainedModel,
    cache: StaticKV,
    ids: torch.Tensor,
    pos: torch.Tensor,
    mask: torch.Tensor,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """One eager forward whose KV goes to `slots` (a device tensor, the static shapes graphs
    need) or, with None, to the cache's next slots. Returns the logits."""
    cache.write_slots = slots
    try:
        out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    finally:
        cache.write_slots = None
    return out.logits


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class GraphedForward:
    """The verify forward of one model over one `StaticKV`, graph-captured per bucket."""

    def __init__(self, model: PreTrainedModel, cache: StaticKV) -> None:
        self.model = model
        self.cache = cache
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.epoch = cache.epoch
        self.pool = None
        self.enabled = True
        # the last forward ran as its shape will keep running: a graph, or eager for good
        # (too big, graphs off); not the step that captured (its two warm-ups and the capture
        # are no step's cost)
        self.last_steady = True
        self.captures = 0  # graphs captured, recaptures after a reallocated cache included
        self.eager_steps = 0  # forwards run eagerly (too big, graphs off)

    def bucket(self, rows: int, tokens: int) -> tuple[int, int]:
        """The padded (rows, tokens) shape a step of this size runs at."""
        shape = (bucket_of(rows), bucket_of(tokens))
        if not self.enabled or shape[0] * shape[1] > MAX_TOKENS:
            return rows, tokens
        return shape

    def __call__(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """Logits `[rows, tokens, V]` of the padded batch; writes KV at `[start, start + n)`.
        A bucket is captured at its first step."""
        shape = (ids.shape[0], ids.shape[1])
        slots = torch.arange(start, start + shape[1], device=ids.device)
        if self.cache.epoch != self.epoch:  # the buffers moved: every capture is stale
            self.graphs.clear()
            # and so is their memory pool: the allocator may still hold it with no graph
            # using it, and a capture into such a pool fails its `use_count > 0` assert
            self.pool = None
            self.epoch = self.cache.epoch
        g = self.graphs.get(shape)
        # a bucket, not a shape past them (`bucket` leaves those as they are) or one between
        capturable = shape == self.bucket(*shape) and shape[0] * shape[1] <= MAX_TOKENS
        fresh = g is None and self.enabled and capturable
        if fresh:
            g = self._capture(ids, pos, mask, slots)
            self.captures += g is not None
        # eager for good (graphs off, or a shape past the buckets), or replayed: steady
        self.last_steady = not fresh and (g is not None or not self.enabled or not capturable)
        if g is None:
            self.eager_steps += 1
            return self._eager(ids, pos, mask, slots)
        g.ids.copy_(ids)
        g.pos.copy_(pos)
        g.mask.copy_(mask)
        g.slots.copy_(slots)
        g.graph.replay()
        return g.logits

    def _eager(self, ids, pos, mask, slots) -> torch.Tensor:
        return forward_at(self.model, self.cache, ids, pos, mask, slots)

    def _capture(self, ids, pos, mask, slots) -> _Graph | None:
        """Warm up on a side stream, then capture; the writes land in free slots."""
        static = [t.clone() for t in (ids, pos, mask, slots)]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._eager(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            self.cache.write_slots = static[3]
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model(
                    static[0],
                    attention_mask=static[2],
                    position_ids=static[1],
                    past_key_values=self.cache,
                ).logits
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            log.warning("CUDA graph capture failed (%s); running the forward eagerly", e)
            self.enabled = False
            return None
        finally:
            self.cache.write_slots = None
        self.pool = graph.pool()
        g = _Graph(graph, *static, logits)
        self.graphs[(ids.shape[0], ids.shape[1])] = g
        return g
