"""The batch's KV cache: preallocated, rewritten in place, never grown per step.

Every layer's `[row_capacity, kv_heads, capacity, head_dim]` keys and values are views of one
tensor (`StaticKV.kv`), so keeping a step's slots is one op for the whole model; it also holds
`valid[row_capacity, capacity]`, the slots each row may attend to. All rows share one
write position, `length`: a forward of `n` tokens writes slots `[length, length + n)` of every
row, and the caller then keeps what it accepted (`keep_region`). A row's valid slots need not
be contiguous: positions are logical (prefix length + depth), so holes change nothing a row
computes. Accepted tree nodes sit at contiguous depths, so the RoPE keys computed in the tree
stay valid after the rewrite.

Attention sees either the slots in use (`[0, length + n)`, the default: least work) or, with
`full_view`, the whole buffer (`[0, capacity)`, static shapes for CUDA graphs; slots past the
ones in use are masked). Capacity grows by half again when a join or a step needs more, which
invalidates captured graphs (`epoch` counts reallocations); a cache far larger than its rows
use shrinks (`shrink`), so a long request's slots are given back when it leaves. The buffers
are inference tensors, allocated and rewritten under `torch.inference_mode` whoever calls (a
row dropped from outside a step included).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

SHRINK_FLOOR_BYTES = 256 << 20
"""A cache at most this large is never shrunk (reallocating it would save little)."""


def _grown(current: int, needed: int) -> int:
    """A dimension's new size: half as large again (so a cache that grows a token a step
    reallocates a logarithmic number of times), or what is needed if more."""
    return max(needed, current + current // 2)


def trim_host_memory(device: torch.device) -> None:
    """Return the host allocator's free pages to the system (glibc's `malloc_trim`), so that a
    process that held a long request's work goes back to its size. Nothing elsewhere."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # not glibc: it returns memory its way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys and values; writes where its `StaticKV` says."""

    def __init__(self, owner: StaticKV) -> None:
        super().__init__()
        # no cycle: a cache no longer used (a prefill's) is freed at once, not by a GC pass
        self.owner = weakref.proxy(owner)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("StaticKV allocates its layers up front")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.owner
        rows, n = key_states.shape[0], key_states.shape[2]
        if kv.write_slots is not None:  # static shapes: slots from a device tensor
            self.keys[:rows].index_copy_(2, kv.write_slots, key_states)
            self.values[:rows].index_copy_(2, kv.write_slots, value_states)
        else:
            self.keys[:rows, :, kv.length : kv.length + n] = key_states
            self.values[:rows, :, kv.length : kv.length + n] = value_states
        end = self.keys.shape[2] if kv.full_view else kv.length + n
        return self.keys[:rows, :, :end], self.values[:rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


@dataclass(frozen=True)
class LayerKV:
    keys: torch.Tensor  # [rows, kv_heads, width, head_dim]
    values: torch.Tensor


@dataclass(frozen=True)
class PrefilledRows:
    """Prefilled keys and values of rows, left padded to one width (`valid` says which slots
    are real): what `StaticKV.append_rows` copies in, as it does a prefill's `DynamicCache`."""

    layers: list[LayerKV]
    valid: torch.Tensor  # [rows, width] bool


def slot_bytes(model: PreTrainedModel) -> int:
    """Bytes one row's token takes in the cache: keys and values of every layer."""
    cfg = model.config.get_text_config()
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


def default_kv_budget(device: torch.device) -> int:
    """What the batch's cache may hold where none is set: 90% of the GPU's free memory once
    the model is loaded, half the memory the system has available on a CPU."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, StopIteration, ValueError):
        lines = Path("/proc/meminfo").read_text().splitlines()
        available = next(line for line in lines if line.startswith("MemAvailable:"))
        return int(available.split()[1]) * 1024 // 2
    return 8 << 30


def prompt_cache_bytes(device: torch.device) -> int:
    """What the prompt cache may hold: 128 MiB on a CPU (SmolLM2's 2,800 tokens in float32: a
    LiveCodeBench or GPQA prompt), 2 GiB on a GPU."""
    return (2 << 30) if device.type == "cuda" else (128 << 20)


def _entry_bytes(layers: list[LayerKV]) -> int:
    return sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))


class PromptCache:
    """The prefilled keys and values of the last `capacity` distinct prompts within `max_bytes`,
    each `[1, kv_heads, len, head_dim]` per layer: a best-of-N problem's prompt is prefilled
    once, however its trajectories join (vLLM's prefix caching, whole prompts only). A prompt
    larger than `max_bytes` is not kept, so a long request's keys leave with it."""

    def __init__(self, capacity: int = 8, max_bytes: int = 128 << 20) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[tuple[int, ...], list[LayerKV]] = OrderedDict()
        self.nbytes = 0

    def get(self, prompt: tuple[int, ...]) -> list[LayerKV] | None:
        """The prompt's entry, now the most recently used; None if not kept."""
        if prompt not in self._entries:
            return None
        self._entries.move_to_end(prompt)
        return self._entries[prompt]

    def put(self, prompt: tuple[int, ...], layers: list[LayerKV]) -> None:
        if prompt in self._entries:
            self.nbytes -= _entry_bytes(self._entries.pop(prompt))
        size = _entry_bytes(layers)
        if size > self.max_bytes:
            return
        self._entries[prompt] = layers
        self.nbytes += size
        while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
            self.nbytes -= _entry_bytes(self._entries.popitem(last=False)[1])


def padded_rows(prompts: list[tuple[int, ...]], entries: list[list[LayerKV]]) -> PrefilledRows:
    """Each prompt's prefilled entry (`PromptCache`'s form), left padded to the longest."""
    width = max(len(p) for p in prompts)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    layers: list[LayerKV] = []
    sample = next((e for e in entries if e), None)
    if sample is not None:
        for i in range(len(sample)):
            k = sample[i].keys
            shape = (len(prompts), k.shape[1], width, k.shape[3])
            keys = torch.zeros(shape, dtype=k.dtype, device=k.device)
            values = torch.zeros(shape, dtype=k.dtype, device=k.device)
            for b, (p, e) in enumerate(zip(prompts, entries, strict=True)):
                if p:
                    keys[b, :, width - len(p) :] = e[i].keys[0]
                    values[b, :, width - len(p) :] = e[i].values[0]
            layers.append(LayerKV(keys, values))
    for b, p in enumerate(prompts):
        valid[b, width - len(p) :] = True  # an empty prompt's slice is empty
    device = sample[0].keys.device if sample is not None else valid.device
    return PrefilledRows(layers, valid.to(device))


def fill_holes(keep: Sequence[int]) -> list[int]:
    """The surviving rows `keep` (distinct) in their new order: a row that stays within the new
    batch keeps its place, and the rows past its end fill, in order, the places of those that
    left, so that a leave moves no more rows than left (`StaticKV.select_rows`)."""
    k = len(keep)
    stay = {b for b in keep if b < k}
    out = list(range(k))
    holes = (i for i in range(k) if i not in stay)
    for i, b in zip(holes, [b for b in keep if b >= k], strict=True):
        out[i] = b
    return out


class StaticKV(Cache):
    """The preallocated cache of a batch of rows (see the module docstring)."""

    def __init__(
        self, model: PreTrainedModel, rows: int = 1, capacity: int = 256, shards: int = 1
    ) -> None:
        """`shards`: the tensor-parallel ranks the KV heads are split over; each holds its
        share (`engine.tp`)."""
        cfg = model.config.get_text_config()
        self.shards = shards
        self.kv_heads = (cfg.num_key_value_heads or cfg.num_attention_heads) // shards
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype, self.device = model.dtype, model.device
        super().__init__(layers=[SlotLayer(self) for _ in range(cfg.num_hidden_layers)])
        self.rows = 0  # rows in the batch
        self.length = 0  # slots in use, the same for every row
        self.full_view = False
        self.write_slots: torch.Tensor | None = None
        self.epoch = 0
        self._allocate(max(rows, 1), max(capacity, 1))

    # -- capacity ---------------------------------------------------------------------------
    @property
    def row_capacity(self) -> int:
        return self.valid.shape[0]

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @torch.inference_mode()
    def _allocate(self, rows: int, capacity: int) -> None:
        """Every layer's keys and values are views of one tensor, so that keeping a step's
        accepted slots (every tree step) is one gather for the whole model instead of two per
        layer (on a GPU, ~110 kernel launches a tree step for a 28-layer model, ~1 ms). The
        rare rewrites whose copy is as large as the cache (compaction, rows joining) go a layer
        at a time, one op for its keys and values, and rows leaving copy the moved rows in
        chunks of layers no larger (`select_rows`), so that they never hold a second copy of
        the whole cache; growing does (the old and the new tensor)."""
        shape = (2, len(self.layers), rows, self.kv_heads, capacity, self.head_dim)
        kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if hasattr(self, "kv"):
            kv[:, :, : self.rows, :, : self.length] = self.kv[:, :, : self.rows, :, : self.length]
        self.kv = kv  # [2, layers, rows, kv_heads, capacity, head_dim]
        for i, layer in enumerate(self.layers):
            layer.keys, layer.values, layer.is_initialized = kv[0, i], kv[1, i], True
        valid = torch.zeros(rows, capacity, dtype=torch.bool, device=self.device)
        if hasattr(self, "valid"):
            valid[: self.rows, : self.length] = self.valid[: self.rows, : self.length]
        self.valid = valid
        self.epoch += 1

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def slot_bytes(self) -> int:
        """Bytes of one row's slot over every layer, keys and values."""
        return self.nbytes // (self.row_capacity * self.capacity)

    @torch.inference_mode()
    def reserve(self, rows: int, capacity: int) -> None:
        """Make room for `rows` rows and `capacity` slots: slots half as many again as asked
        for, with exactly the rows asked for (a long row joining a batch makes every row as
        long, `append_rows`: spare rows would cost as much); rows alone half as many again."""
        if capacity > self.capacity:
            self._allocate(max(rows, self.rows, 1), _grown(self.capacity, capacity))
        elif rows > self.row_capacity:
            self._allocate(_grown(self.row_capacity, rows), self.capacity)

    @torch.inference_mode()
    def shrink(self) -> bool:
        """Give back what the batch no longer uses (rows left, the cache compacted): where the
        cache holds over four times its rows' slots in use, and more than
        `SHRINK_FLOOR_BYTES`, reallocate it half as large again as they are. True if it did."""
        rows, length = max(self.rows, 1), self.length + 1
        used = rows * length * self.slot_bytes()
        if self.nbytes <= max(SHRINK_FLOOR_BYTES, 4 * used):
            return False
        self.resize(rows, _grown(length, length))
        return True

    def resize(self, rows: int, capacity: int) -> None:
        """Reallocate to `rows` rows of `capacity` slots, at least those in use (`shrink`)."""
        self._allocate(max(rows, self.rows), max(capacity, self.length + 1))

    def active_valid(self) -> torch.Tensor:
        """`[rows, length]`: the slots each row attends to."""
        return self.valid[: self.rows, : self.length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # -- rewrites, all in place -------------------------------------------------------------
    def _rows_kv(self) -> torch.Tensor:
        """`[2, layers, rows, kv_heads, capacity, head_dim]`: the batch's rows, every layer."""
        return self.kv[:, :, : self.rows]

    @torch.inference_mode()
    def keep_region(self, start: int, keep: np.ndarray) -> None:
        """After a forward wrote slots from `start`: row b keeps slots `start + keep[b]`
        (`[rows, m]` int64, in order; -1 pads a short row) at `[start, start + m)`, valid there
        and nowhere else in it, and the cache ends there. Only the written region is copied,
        never the prefix; the slots and their flags go to the device in one copy."""
        rows, m = keep.shape
        host = np.concatenate([start + np.maximum(keep, 0), keep >= 0], axis=1)
        sel, valid = torch.from_numpy(host).to(self.device, non_blocking=True).split(m, 1)
        kv = self._rows_kv()
        sel = sel.view(1, 1, rows, 1, m, 1).expand(*kv.shape[:4], m, self.head_dim)
        kv[..., start : start + m, :] = kv.gather(4, sel)
        self.valid[: self.rows, start : start + m] = valid
        self.length = start + m

    @torch.inference_mode()
    def keep_roots(self, start: int) -> None:
        """`keep_region` when every row keeps only its root (a plain step, or nothing accepted):
        the root is already at `start`, so only the length and its validity change."""
        self.valid[: self.rows, start] = True
        self.length = start + 1

    @torch.inference_mode()
    def gather_slots(self, idx: torch.Tensor, valid: torch.Tensor) -> None:
        """Row b keeps its slots `idx[b]` (`[rows, m]`) at `[0, m)`, valid where `valid` says;
        the cache becomes m long (compaction)."""
        m = idx.shape[1]
        kv = self._rows_kv()
        sel = idx[None, :, None, :, None].expand(2, *kv.shape[2:4], m, self.head_dim)
        for layer in range(kv.shape[1]):  # a layer at a time: the copy is the whole cache
            kv[:, layer, ..., :m, :] = kv[:, layer].gather(3, sel)
        self.valid[: self.rows, :m] = valid
        self.valid[: self.rows, m:] = False
        self.length = m

    @torch.inference_mode()
    def select_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows `keep` (host indices, distinct), in that order at the top (rows leave
        the batch). Only the rows whose place changes are copied: with `fill_holes`' order, as
        many rows' caches as left the batch, where moving every surviving row up copied the
        whole batch's cache (a 7B's 64 rows at 4k: ~15 GB of reads and writes per leave). The
        copy takes as many layers at once as keep its temporary within k rows of one layer
        (what moving every row a layer at a time held): one op when a few rows leave."""
        k = len(keep)
        moved = [i for i, b in enumerate(keep) if b != i]
        if moved:
            at = torch.tensor([moved, [keep[i] for i in moved]], device=self.kv.device)
            dst, src = at.unbind(0)
            used, layers = slice(0, self.length), self.kv.shape[1]
            chunk = max(1, k // len(moved))
            for a in range(0, layers, chunk):
                ls = slice(a, a + chunk)
                self.kv[:, ls, dst, :, used] = self.kv[:, ls, src, :, used]
            self.valid[dst] = self.valid[src]
        self.valid[k:] = False
        self.rows = k

    @torch.inference_mode()
    def fill_random(self, rows: int, length: int, seed: int = 0) -> None:
        """`rows` rows of `length` random entries, all attended: attention over them costs what
        it does over real ones, without a prefill (16 × 4096 tokens take minutes on a CPU)."""
        self.clear()
        self.reserve(rows, length + 1)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf[:rows, :, :length].normal_(generator=gen)
        self.valid[:rows, :length] = True
        self.rows, self.length = rows, length

    def discard_prefill(self, prefill: DynamicCache) -> None:
        """A prefill's cache that no row will join from (its rows left while it ran): nothing
        to do here; a tensor-parallel follower frees its own (`engine.tp`)."""

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (a timed forward's writes)."""
        self.length = length

    @torch.inference_mode()
    def clear(self) -> None:
        """No rows, nothing in use (the buffers stay allocated)."""
        self.valid.fill_(False)
        self.rows = self.length = 0

    @torch.inference_mode()
    def append_rows(
        self,
        new: DynamicCache | PrefilledRows,
        new_valid: torch.Tensor,
        source_rows: torch.Tensor | None = None,
    ) -> None:
        """Add a prefilled batch below the rows here (rows joining a running batch). The
        shorter side is left padded with invalid slots, which no row attends to.

        `source_rows[i]`: the prefilled row that joining row i copies (rows with one prompt
        share one prefill); default, one joining row per prefilled row."""
        if source_rows is not None:
            source_rows = source_rows.to(self.device)
            new_valid = new_valid.to(self.device)[source_rows]
        k, width = new_valid.shape
        joint = max(self.length, width)
        self.reserve(self.rows + k, joint + 1)
        shift = joint - self.length
        if shift and self.rows:  # move the rows here right, so both sides end at `joint`
            kv = self._rows_kv()
            for layer in range(kv.shape[1]):  # a layer at a time: the copy is the rows' cache
                kv[:, layer, ..., shift:joint, :] = kv[:, layer, ..., : self.length, :].clone()
            self.valid[: self.rows, shift:joint] = self.valid[: self.rows, : self.length].clone()
            self.valid[: self.rows, :shift] = False
        rows = slice(self.rows, self.rows + k)
        if width:
            for layer, src in zip(self.layers, new.layers, strict=True):
                keys, values = src.keys, src.values
                if source_rows is not None:
                    keys, values = keys[source_rows], values[source_rows]
                layer.keys[rows, :, joint - width : joint] = keys
                layer.values[rows, :, joint - width : joint] = values
        self.valid[rows] = False
        self.valid[rows, joint - width : joint] = new_valid.to(self.device)
        self.rows += k
        self.length = joint


class PrefillKV(StaticKV):
    """One prefill job's keys and values (`engine.prefill`): `rows` prompts of `width` slots,
    allocated once and filled a chunk at a time, so a long prompt's prefill never grows (and
    copies) its cache; `StaticKV.append_rows` takes it as it takes a `DynamicCache`."""

    def __init__(self, model: PreTrainedModel, rows: int, width: int, shards: int = 1) -> None:
        super().__init__(model, rows=rows, capacity=width, shards=shards)
        self.rows = rows

    def advance(self, n: int) -> None:
        """The last forward's `n` slots are written: the next writes after them."""
        self.length += n
