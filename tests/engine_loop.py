"""The engine's unit tests drive `BatchDecoder` directly, without the runner: one row to
completion (`generate`, the speculative counterpart of `decode.plain_generate`), or a fixed
set of rows (`decode_rows`). Production code steps the decoder only in `runner.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder, Row
from tts_service.engine.decode import GenerationResult, OnCommit, plain_generate
from tts_service.engine.seam import Drafter
from tts_service.runner import nodes_per_row


def plain_greedy(model, prompts: Sequence[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """Each prompt decoded alone, greedily, without drafts (`decode.plain_generate`): what every
    row of a greedy batch must commit."""
    return [
        plain_generate(
            model, p, SamplingConfig(temperature=0, max_new_tokens=n), eos_ids=[]
        ).token_ids
        for p, n in zip(prompts, lengths, strict=True)
    ]


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
