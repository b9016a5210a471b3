"""The shared store's replication log: a scope's rows as entries of one Redis Stream, in a
compact binary form (docs/store.md, "Replication").

An entry is one writer's round trip: fields `w` (the writer's id), `s` (its batch number, 1,
2, ...), `t` (when its oldest row was learned, unix seconds) and `d` (the rows, `encode_rows`).
The server appends, trims and forwards; it does no per-token arithmetic. Every reader merges
every entry into its own index once: a copy of a batch it has applied (a writer resends a batch
until acknowledged) is skipped by its number, and a gap in a writer's numbers (a log trimmed
before a late reader came) is counted.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

HEADER = np.dtype(np.int32)  # rows, ids per row, n-gram order


class LogRows(NamedTuple):
    """Rows as `StoreIndex.add_arrays` takes them: `ctx` `[R, order]` int64 right-aligned,
    -1 padded; `clen` `[R]` the context's length (at most `order` is kept); `ids` `[R, W]` int64
    and `probs` `[R, W]` float64 the distribution, of which `n` `[R]` are real."""

    ctx: np.ndarray
    clen: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    n: np.ndarray


def concat_rows(parts: list[LogRows]) -> LogRows:
    """One block of rows from several steps' (their id widths padded to the widest)."""
    width = max(p.ids.shape[1] for p in parts)
    ids = np.zeros((sum(len(p.ids) for p in parts), width), np.int64)
    probs = np.zeros(ids.shape, np.float64)
    at = 0
    for p in parts:
        rows, cols = p.ids.shape
        ids[at : at + rows, :cols] = p.ids
        probs[at : at + rows, :cols] = p.probs
        at += rows
    return LogRows(
        np.concatenate([p.ctx for p in parts]),
        np.concatenate([p.clen for p in parts]),
        ids,
        probs,
        np.concatenate([p.n for p in parts]),
    )


def encode_rows(rows: LogRows) -> bytes:
    """Rows as bytes: a header, contexts and ids as int32, probabilities as float64 (a reader
    that merges a writer's rows in its order holds the writer's entries bit for bit), lengths
    as uint8: 138 bytes a row at order 4 and top 10."""
    count, order = rows.ctx.shape
    width = rows.ids.shape[1]
    parts = (
        np.array([count, width, order], HEADER),
        rows.ctx.astype(np.int32),
        np.minimum(rows.clen, order).astype(np.uint8),
        rows.ids.astype(np.int32),
        rows.probs.astype(np.float64),
        rows.n.astype(np.uint8),
    )
    return b"".join(p.tobytes() for p in parts)


def decode_rows(data: bytes, order: int) -> LogRows:
    """`encode_rows`' bytes -> rows for an index of n-gram order `order` (a writer's longer
    contexts keep their last `order` tokens, shorter ones are padded).

    Raises:
        ValueError: the bytes are not a whole block of rows.
    """
    count, width, theirs = np.frombuffer(data, HEADER, 3)
    at = 3 * HEADER.itemsize
    fields = []
    for dtype, shape in (
        (np.int32, (count, theirs)),
        (np.uint8, (count,)),
        (np.int32, (count, width)),
        (np.float64, (count, width)),
        (np.uint8, (count,)),
    ):
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        fields.append(np.frombuffer(data, dtype, int(np.prod(shape)), at).reshape(shape))
        at += size
    if at != len(data):
        raise ValueError(f"a log entry of {len(data)} bytes, expected {at}")
    ctx_in, clen, ids, probs, n = fields
    ctx = np.full((count, order), -1, np.int64)
    keep = min(order, int(theirs))
    if keep:
        ctx[:, order - keep :] = ctx_in[:, int(theirs) - keep :]
    return LogRows(
        ctx,
        np.minimum(clen, keep).astype(np.int64),
        ids.astype(np.int64),
        probs.astype(np.float64),
        n.astype(np.int64),
    )
