"""The engine's unit tests drive `BatchDecoder` directly, without the runner: one row to
completion (`generate`, the speculative counterpart of `decode.plain_generate`), or a fixed
set of rows (`decode_rows`). Production code steps the decoder only in `runner.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tts_service.drafters.base import Drafter
from tts_service.engine.batch import BatchDecoder, Row
from tts_service.engine.decode import GenerationResult, OnCommit
from tts_service.runner import nodes_per_row


def decode_rows(
    decoder: BatchDecoder, rows: list[Row], token_budget: int = 64
) -> list[GenerationResult]:
    """Decode `rows` to completion together, `token_budget` tokens per forward."""
    decoder.join(rows)
    while decoder.active:
        decoder.step(nodes_per_row(token_budget, len(decoder.active)))
    return [r.result() for r in rows]


def generate(
    model,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    cfg,
    eos_ids: Sequence[int],
    decode: Callable[[list[int]], str] | None = None,
    max_nodes: int = 1024,
    on_commit: OnCommit | None = None,
) -> GenerationResult:
    """Speculative tree decoding of one sequence (a batch of one row), `max_nodes` per step."""
    decoder = BatchDecoder(model, eos_ids, decode)
    row = decoder.new_row(list(prompt_ids), drafter, cfg, on_commit)
    decoder.join([row])
    while decoder.active:
        decoder.step(max_nodes)
    return row.result()
