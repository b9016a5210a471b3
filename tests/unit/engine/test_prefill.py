"""Chunked prefill: bounded forwards, the rows decoding never wait for a whole prompt, and every
row still commits exactly what plain decoding does."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter
from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions
from tts_service.engine.prefill import MIN_CHUNK, PrefillJob, chunk_tokens, join_groups

VOCAB = 64


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunk_tokens_takes_the_whole_limit_while_no_row_decodes():
    assert chunk_tokens(None, 0.01, 512) == 512
    assert chunk_tokens(0.1, None, 512) == 512  # no rate measured yet


def test_chunk_tokens_costs_about_one_step_within_its_bounds():
    assert chunk_tokens(0.1, 0.001, 512) == 100
    assert chunk_tokens(10.0, 0.001, 512) == 512
    assert chunk_tokens(0.001, 0.001, 512) == MIN_CHUNK


def test_join_groups_puts_short_prompts_together_and_each_long_one_alone():
    prompts = [(1,) * 3, (2,) * 40, (3,) * 5, (2,) * 40, (4,) * 50]
    assert join_groups(prompts, 16) == [[0, 2], [1, 3], [4]]
    assert join_groups([(1,) * 40], 16) == [[0]]


def test_a_chunk_mask_is_the_chunk_by_its_context(tiny_model):
    """The mask of positions [done, end) has `end` keys, and is the rows of the whole-prompt
    causal mask (left padding blocked, each padding slot sees itself)."""
    job = PrefillJob.of([(5, 6, 7, 8, 9), (5, 6)], tiny_model)  # widths 5 and 2: 3 padding slots
    job.done = 2
    mask = job.chunk_mask(4, torch.float64)
    assert mask.shape == (2, 1, 2, 4)
    allowed = mask == 0
    full = torch.ones(5, 5, dtype=torch.bool).tril()[None] & job.valid[:, None, :]
    full |= torch.eye(5, dtype=torch.bool)[None]
    assert torch.equal(allowed[:, 0], full[:, 2:4, :4])


def test_chunked_prefill_equals_one_forward(tiny_model):
    """A job run 3 positions at a time fills the cache a whole-prompt forward would (float64:
    to rounding), padded rows included."""
    prompts = [tuple(_prompt(11, 1)), tuple(_prompt(7, 2))]
    whole, chunked = PrefillJob.of(prompts, tiny_model), PrefillJob.of(prompts, tiny_model)
    assert whole.advance(tiny_model, 1000) == 22 and whole.finished
    while not chunked.finished:
        assert chunked.advance(tiny_model, 6) <= 6
    valid = chunked.valid
    for a, b in zip(whole.cache.layers, chunked.cache.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):  # [rows, heads, width, dim]
            torch.testing.assert_close(x.transpose(1, 2)[valid], y.transpose(1, 2)[valid])
    assert chunked.entry(1)[0].keys.shape[2] == 7


def _jobs_made(monkeypatch) -> list[list[tuple[int, ...]]]:
    """The prompts of every `PrefillJob` made from now on."""
    jobs: list[list[tuple[int, ...]]] = []
    of = PrefillJob.of
    monkeypatch.setattr(
        PrefillJob, "of", classmethod(lambda cls, ps, *rest: jobs.append(ps) or of(ps, *rest))
    )
    return jobs


def _decoder(model, chunk: int) -> BatchDecoder:
    return BatchDecoder(model, eos_ids=[], options=DecoderOptions(prefill_chunk=chunk))


def _row(decoder, prompt, n, method="pld"):
    cfg = SamplingConfig(temperature=0, max_new_tokens=n)
    return decoder.new_row(prompt, make_drafter(DRAFTER_CONFIGS[method], VOCAB), cfg)


@pytest.mark.parametrize("method", ["plain", "pld", "stand"])
def test_a_long_prompt_prefills_between_the_steps_of_rows_decoding(tiny_model, method):
    """A 120-token prompt admitted while two rows decode runs 16 tokens a step; the rows keep
    stepping, a short prompt admitted after it joins first, and every row equals plain."""
    decoder = _decoder(tiny_model, 16)
    early = [_row(decoder, _prompt(6, s), 40, method) for s in (3, 4)]
    decoder.join(early)
    long = _row(decoder, _prompt(120, 5), 12, method)
    decoder.admit([long])
    steps_while_prefilling, done, short = 0, 0, None
    while decoder.active or decoder.joining:
        joined = decoder.prefill(16)
        if long in decoder.joining:
            job = next(g.job for g in decoder.pending if long in g.rows)
            assert 0 < job.done - done <= 16  # one bounded chunk a step
            done = job.done
            steps_while_prefilling += bool(decoder.active)
        if steps_while_prefilling == 2 and short is None:
            short = _row(decoder, _prompt(5, 6), 6, method)
            decoder.admit([short])
        if short is not None and short in joined:
            assert long in decoder.joining  # the short prompt did not wait for the long one
        if decoder.active:
            decoder.step(0 if method == "plain" else 8)
    assert steps_while_prefilling >= 120 // 16 - 1
    for row in [*early, long, short]:
        ref = plain_generate(tiny_model, row.prompt_ids, row.cfg, eos_ids=[])
        assert row.result().token_ids == ref.token_ids


def test_a_joining_row_dropped_stops_its_prefill(tiny_model):
    decoder = _decoder(tiny_model, 16)
    row = _row(decoder, _prompt(100, 7), 4)
    decoder.admit([row])
    decoder.prefill(16)
    decoder.drop([row])
    assert not decoder.joining and not decoder.pending and not decoder.active
    again = _row(decoder, _prompt(100, 7), 4)
    decoder.join([again])  # the prompt was never finished: prefilled anew, whole
    while decoder.active:
        decoder.step(4)
    ref = plain_generate(tiny_model, again.prompt_ids, again.cfg, eos_ids=[])
    assert again.result().token_ids == ref.token_ids


def test_rows_of_one_long_prompt_prefill_it_once(tiny_model, monkeypatch):
    """Best-of-N over a long prompt: one job for every row of it, kept in the prompt cache."""
    jobs = _jobs_made(monkeypatch)
    decoder = _decoder(tiny_model, 16)
    prompt = _prompt(80, 8)
    decoder.join([_row(decoder, prompt, 3) for _ in range(3)])
    decoder.join([_row(decoder, prompt, 3)])  # a later row: from the prompt cache
    assert jobs == [[tuple(prompt[:-1])]]
    while decoder.active:
        decoder.step(4)


def test_rows_admitted_while_their_prompt_prefills_wait_for_that_job(tiny_model, monkeypatch):
    """A job's pool admits a problem's rows a few at a time: rows whose prompt is being
    prefilled join with that job, never prefilling it again."""
    jobs = _jobs_made(monkeypatch)
    decoder = _decoder(tiny_model, 16)
    prompt = _prompt(80, 9)
    first = [_row(decoder, prompt, 3) for _ in range(2)]
    decoder.admit(first)
    decoder.prefill(16)
    later = [_row(decoder, prompt, 3) for _ in range(2)] + [_row(decoder, _prompt(4, 1), 3)]
    decoder.admit(later)
    assert len(jobs) == 2 and jobs[0] == [tuple(prompt[:-1])] and len(jobs[1][0]) == 3
    while decoder.joining:
        decoder.prefill(16)
    assert len(decoder.active) == 5
    while decoder.active:
        decoder.step(4)
    for row in first + later:
        ref = plain_generate(tiny_model, row.prompt_ids, row.cfg, eos_ids=[])
        assert row.result().token_ids == ref.token_ids
