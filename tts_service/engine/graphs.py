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
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel

from tts_service.engine.kv import StaticKV
from tts_service.engine.tree import DraftTree
from tts_service.engine.treepack import TREE_BLOCKS, TreeBatch, tree_arrays

log = logging.getLogger(__name__)

MAX_TOKENS = 1024
"""The largest rows × tokens bucket captured; bigger steps run eagerly."""

MAX_ACCEPTANCE_GRAPHS = 64
"""Acceptance captures kept (one per bucket and sampling parameters): a server's clients may
choose their parameters freely, and each new set costs a capture; past this many, new ones
run eagerly."""


def bucket_of(n: int) -> int:
    """The power of two at or above `n`."""
    return 1 << max(0, n - 1).bit_length()


def is_bucket(rows: int, tokens: int) -> bool:
    """A shape that is captured: both powers of two, within `MAX_TOKENS` (not a shape between
    buckets, nor one past them)."""
    return (rows, tokens) == (bucket_of(rows), bucket_of(tokens)) and rows * tokens <= MAX_TOKENS


def bucket_shape(rows: int, tokens: int) -> tuple[int, int]:
    """The padded (rows, tokens) shape a step of this size is captured at: both rounded up to
    powers of two, or the shape itself past `MAX_TOKENS`."""
    shape = (bucket_of(rows), bucket_of(tokens))
    return (rows, tokens) if shape[0] * shape[1] > MAX_TOKENS else shape


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
        # (too big, graphs off); not the step that captured (its warm-up and the capture are
        # no step's cost)
        self.last_steady = True
        self.captures = 0  # graphs captured, recaptures after a reallocated cache included
        self.eager_steps = 0  # forwards run eagerly (too big, graphs off)

    def bucket(self, rows: int, tokens: int) -> tuple[int, int]:
        """The padded (rows, tokens) shape a step of this size runs at."""
        return bucket_shape(rows, tokens) if self.enabled else (rows, tokens)

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
        capturable = is_bucket(*shape)
        fresh = g is None and self.enabled and capturable
        if fresh:
            g = self._capture(ids, pos, mask, slots)
            self.captures += g is not None
        # eager for good (graphs off, or a shape past the buckets), or replayed: steady
        self.last_steady = not fresh and (g is not None or not self.enabled or not capturable)
        if fresh and g is not None:  # the step's logits are the warm-up's, in the graph's buffer
            return g.logits
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
        """Run the step once eagerly on a side stream (the warm-up a capture needs, and the
        step's own forward: its KV writes and logits are the step's), then capture; the
        capture runs nothing, so the step costs one eager forward and the capture, not two
        warm-ups, the capture and a replay."""
        static = [t.clone() for t in (ids, pos, mask, slots)]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm = self._eager(*static)
            torch.cuda.current_stream().wait_stream(side)
            warm.record_stream(torch.cuda.current_stream())
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
        logits.copy_(warm)
        g = _Graph(graph, *static, logits)
        self.graphs[(ids.shape[0], ids.shape[1])] = g
        return g


@dataclass
class StepInputs:
    """A bucket's static inputs to its captured acceptance, filled on the host's side of each
    step (`fill`): the trees (`treepack.tree_arrays`' layout) and the uniforms' block
    (`streams.node_uniform_block`). The trees' ints and the uniforms share one int64 block, the
    uniforms as their float64 bits, so a sampled step copies both in one copy."""

    block: torch.Tensor  # [R, (TREE_BLOCKS + 3) * N] long: the trees' ints, the uniforms' bits
    masks: torch.Tensor  # [2, R, N, N] bool
    ints: torch.Tensor = field(init=False)  # [R, TREE_BLOCKS * N] long, a view of `block`
    uvw: torch.Tensor = field(init=False)  # [R, 3N] float64, a view of `block`

    def __post_init__(self) -> None:  # the views once: a captured graph reads these tensors
        cut = TREE_BLOCKS * self.masks.shape[-1]
        self.ints, self.uvw = self.block[:, :cut], self.block[:, cut:].view(torch.float64)

    @staticmethod
    def zeros(rows: int, tokens: int, device: torch.device) -> StepInputs:
        width = (TREE_BLOCKS + 3) * tokens
        return StepInputs(
            torch.zeros(rows, width, dtype=torch.long, device=device),
            torch.zeros(2, rows, tokens, tokens, dtype=torch.bool, device=device),
        )

    @property
    def trees(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ints, self.masks

    def fill(
        self, trees: Sequence[DraftTree], roots: Sequence[int], uniforms: np.ndarray | None
    ) -> TreeBatch:
        """Write a step's trees (one per bucket row, padded to its width) and, for sampled rows,
        their uniforms `[R, 3N]` float64: two host-to-device copies (`non_blocking`); the tree
        batch over the buffers."""
        ints, masks = tree_arrays(trees, self.masks.shape[-1], roots)
        if uniforms is None:
            self.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        else:
            host = np.concatenate([ints, uniforms.view(np.int64)], axis=1)
            self.block.copy_(torch.from_numpy(host), non_blocking=True)
        self.masks.copy_(torch.from_numpy(masks), non_blocking=True)
        return TreeBatch.views(self.ints, self.masks)


@dataclass
class _Captured:
    replay: Callable[[], object]
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor


class GraphedAcceptance:
    """A verify step's acceptance (`treebatch.step_verdict`: p, the top-k, rules (a) and (b),
    the bonus and the one tensor the host copies back) captured as a CUDA graph per (bucket,
    sampling parameters) and replayed each step: ~70 ops (kernel launches and views) become
    one replay.

    The inputs are static: the forward's logits (a captured forward's own output buffer, so
    nothing is copied) and the bucket's `StepInputs`, which the host fills before the forward
    (`StepInputs.fill` writes the trees there, and `_pack` reads them from there). An input that is
    not the captured tensor itself is copied into it. A capture that fails turns these graphs
    off with a warning; the acceptance then runs eagerly, as it does for shapes past the
    buckets, batches of several sampling parameters, and sets of parameters past
    `MAX_ACCEPTANCE_GRAPHS`. Steps with rows walked on the host (rule (c)) are captured per
    support width (`treebatch.step_verdict_walked`), their supports a static input of their own
    (`supports`).

    Memory: the captures share one private pool, which keeps the acceptance's largest working
    set (p in float64, `[rows, tokens, V]`, and what is computed from it) for as long as they
    live, where the eager acceptance returns it to the caching allocator after each step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple[int, int], StepInputs] = {}
        self.support_buffers: dict[tuple[int, ...], torch.Tensor] = {}
        self.host_buffers: dict[tuple, tuple[torch.Tensor, np.ndarray]] = {}
        self.graphs: dict[Hashable, _Captured] = {}
        self.pool = None
        self.enabled = True
        self.captures = 0

    def inputs(self, rows: int, tokens: int) -> StepInputs | None:
        """The static inputs of a step padded to (`rows`, `tokens`), a bucket; None where the
        step is no bucket (or these graphs are off): it runs eagerly."""
        if not self.enabled or not is_bucket(rows, tokens):
            return None
        shape = (rows, tokens)
        buf = self.buffers.get(shape)
        if buf is None:
            buf = self.buffers[shape] = StepInputs.zeros(rows, tokens, self.device)
        return buf

    def supports(self, host: np.ndarray) -> torch.Tensor:
        """`host` (`SparseLayout.supports`: a bucket's rows, tokens and support width) copied
        into the static tensor of its shape, which a walked step's capture reads."""
        buf = self.support_buffers.get(host.shape)
        if buf is None:
            buf = torch.zeros(host.shape, dtype=torch.long, device=self.device)
            self.support_buffers[host.shape] = buf
        return buf.copy_(torch.from_numpy(host), non_blocking=True)

    def to_host(self, out: torch.Tensor) -> np.ndarray:
        """A replay's output copied into the host buffer of its shape (pinned on a GPU), flat:
        the step's one synchronisation, and one dispatched op where `.cpu().numpy()` is five.
        The array is that buffer: the next replay of the same shape overwrites it, so whatever
        outlives the step is copied out of it."""
        key = (tuple(out.shape), out.dtype)
        entry = self.host_buffers.get(key)
        if entry is None:
            buf = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.is_cuda)
            entry = self.host_buffers[key] = (buf, buf.numpy().reshape(-1))
        entry[0].copy_(out)
        return entry[1]

    def __call__(
        self, key: Hashable, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor | None:
        """`fn(*inputs)`, replayed from the capture for `key` (captured at its first step);
        None where the capture failed (the caller runs it eagerly)."""
        g = self.graphs.get(key)
        if g is None:
            full = len(self.graphs) >= MAX_ACCEPTANCE_GRAPHS
            g = self._capture(fn, inputs) if self.enabled and not full else None
            if g is None:
                return None
            self.graphs[key] = g
            self.captures += 1
        for static, x in zip(g.inputs, inputs, strict=True):
            if x is not static:
                static.copy_(x)
        g.replay()
        return g.output

    def clear(self) -> None:
        """Drop every capture (the forward's graphs, whose logits they read, were captured
        again); the static inputs stay."""
        self.graphs.clear()
        self.pool = None

    def _capture(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
    ) -> _Captured | None:
        """Warm up once on a side stream, then capture over the inputs as they are (static)."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = fn(*inputs)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            log.warning("CUDA graph capture of the acceptance failed (%s); running it eagerly", e)
            self.enabled = False
            return None
        self.pool = graph.pool()
        return _Captured(graph.replay, inputs, out)


class EagerReplayedAcceptance(GraphedAcceptance):
    """`GraphedAcceptance` where no GPU is: the same buckets, static inputs and copies, with
    each replay running the function eagerly over the static inputs. It checks the captured
    path's data flow on a CPU (the tests), and lets the host benchmark see what a GPU host does
    around a replay: the replays run in a `graph` profiler scope and their seconds are counted
    (`replay_s`), the device's work, as the stand-in forward's is."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.replay_s = 0.0

    def _capture(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
    ) -> _Captured | None:
        captured = _Captured(lambda: None, inputs, fn(*inputs))

        def replay() -> None:  # a new output each time: the host's copy of it is not a view
            t0 = time.perf_counter()
            with torch.profiler.record_function("graph"):
                captured.output = fn(*inputs)
            self.replay_s += time.perf_counter() - t0

        captured.replay = replay
        return captured
