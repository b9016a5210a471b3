"""Pay a forward's one-time costs before the first request: compiling it and capturing graphs.

A compiled forward (`model.compile`) compiles at the first step of each new shape, and on a GPU
every (rows, tokens) bucket is captured as a CUDA graph at its first step (`engine.graphs`). A
command pays that inside its first steps; a server should pay it at start, not on a user's
first request. `warm_up` runs one verify forward of each shape the decoder will meet over a
random cache (`BatchDecoder.fill_random`, `time_forward`), then leaves the decoder empty: the
compiled kernels and the captured graphs stay. The graphs last until the cache first grows past
what warming reserved (a reallocated cache drops them, `engine.graphs`); they are then
captured again at each bucket's next step, as without warming.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tts_service.engine.graphs import MAX_TOKENS, bucket_of

if TYPE_CHECKING:
    from tts_service.engine.batch import BatchDecoder

WARM_CONTEXT = 256
"""Cached tokens a row holds while warming (the shapes, not the context, are what compile)."""
WIDEST = 64
"""The widest step captured ahead (a tree of 63 nodes a row): wider ones capture when met."""
COMPILED_SHAPES = ((1, 1), (1, 2), (2, 1), (2, 2))
"""Without graphs, the shapes that compile every variant a compiled forward needs (it compiles
for any size, but a size of 1 apart: one row or many, one token or many)."""


def compiled(decoder: BatchDecoder) -> bool:
    """Whether the decoder's forward is compiled (`CompactCausalLM.compile`)."""
    return getattr(decoder.model, "compiled", False)


def warm_shapes(decoder: BatchDecoder, max_rows: int) -> list[tuple[int, int]]:
    """The (rows, tokens) shapes to run ahead: every bucket up to `max_rows` rows where graphs
    capture (as many tokens as one graph takes), else `COMPILED_SHAPES` for a compiled forward,
    else none."""
    graphs = decoder.graphs
    if graphs is not None and graphs.enabled:
        rows = [1 << i for i in range(bucket_of(max_rows).bit_length())]
        widths = [1 << i for i in range(bucket_of(WIDEST).bit_length())]
        return [(r, t) for r in rows for t in widths if r * t <= MAX_TOKENS]
    if compiled(decoder):
        return [s for s in COMPILED_SHAPES if s[0] <= max(max_rows, 1)]
    return []


def warm_up(decoder: BatchDecoder, shapes: list[tuple[int, int]]) -> int:
    """Run one forward of each of `shapes` (`warm_shapes`) on an empty decoder; returns how
    many ran."""
    if not shapes or decoder.active:
        return 0
    decoder.fill_random(max(r for r, _ in shapes), WARM_CONTEXT)
    for rows, tokens in shapes:
        decoder.time_forward(rows, tokens)
    decoder.cache.clear()
    return len(shapes)


def describe(decoder: BatchDecoder, shapes: int) -> str:
    """What warming `shapes` shapes does, for the status line that announces the wait."""
    what = []
    if compiled(decoder):
        from tts_service.engine.compact import inductor_cache_dir

        what.append(f"compiling the forward (torch.compile, kept in {inductor_cache_dir()})")
    if decoder.graphs is not None and decoder.graphs.enabled:
        what.append("capturing its CUDA graphs")
    return f"{' and '.join(what)} for {shapes} step shapes"
