"""Batched decoding: every row commits exactly what it would alone."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows
from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions
from tts_service.engine.seam import DraftContext, Drafter
from tts_service.runner import nodes_per_row

VOCAB = 64


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    base = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 5, 4, 2, 6)]
    # mixed lengths, some repetitive, one single-token prompt
    return [base[0] * 4, base[1] + base[2], base[3] * 3, [7], base[4] * 2, base[2] * 5]


def test_nodes_per_row_shares_the_budget():
    assert nodes_per_row(64, 1) == 63 and nodes_per_row(64, 16) == 3 and nodes_per_row(8, 16) == 0


def test_a_row_needs_a_prompt_token(tiny_model):
    """The last prompt token is the first step's root: a row without one is refused, however
    it is made (the runner builds its rows itself)."""
    decoder = BatchDecoder(tiny_model, eos_ids=[])
    drafter = make_drafter(DRAFTER_CONFIGS["pld"], VOCAB)
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        decoder.new_row([], drafter, SamplingConfig(temperature=0))


@pytest.mark.parametrize("full_view", [False, True], ids=["used-slots", "full-view"])
def test_each_row_is_token_identical_to_plain_greedy_alone(tiny_model, drafter_config, full_view):
    """Rows join (prefill), leave (EOS, max tokens) and compact; `full_view` runs the static
    shapes CUDA graphs replay (attention over the whole preallocated cache)."""
    prompts = _prompts()
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=n) for n in (30, 12, 30, 25, 5, 30)]
    eos = plain_generate(tiny_model, prompts[2], cfgs[2], eos_ids=[]).token_ids[9]
    refs = [
        plain_generate(tiny_model, p, c, eos_ids=[eos]) for p, c in zip(prompts, cfgs, strict=True)
    ]
    decoder = BatchDecoder(
        tiny_model, eos_ids=[eos], options=DecoderOptions(compact_slack=0, full_view=full_view)
    )
    drafters = [make_drafter(drafter_config, VOCAB) for _ in prompts]
    rows = [decoder.new_row(p, d, c) for p, d, c in zip(prompts, drafters, cfgs, strict=True)]
    results = decode_rows(decoder, rows, 48)
    for i, (res, ref) in enumerate(zip(results, refs, strict=True)):
        assert res.token_ids == ref.token_ids, f"row {i}"
        assert res.finish_reason == ref.finish_reason
    assert results[2].finish_reason == "stop"  # a row that finished early on EOS
    if drafter_config.kind != "plain":
        tokens = sum(r.stats.new_tokens for r in results)
        floor = 1.05 if drafter_config.kind == "ptd" else 1.2  # ptd does not copy the prompt
        assert tokens / sum(r.stats.target_forwards for r in results) > floor


class _Spy(BatchDecoder):
    """Records every forward's logits and each row's context and tree (in batch order)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.steps: list[tuple[list, torch.Tensor]] = []
        self.pending: list = []

    def _forward(self, ids, pos, mask, start):
        logits = super()._forward(ids, pos, mask, start)
        self.steps.append((self.pending, logits.clone()))
        self.pending = []
        return logits


class _Recording(Drafter):
    def __init__(self, inner, spy: _Spy):
        self.inner, self.spy = inner, spy

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext):
        tree = self.inner.draft(ctx)
        self.spy.pending.append((list(ctx.tokens), tree))
        return tree

    def observe(self, tree, acc, topk):
        self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens, topk):
        self.inner.observe_root(tokens, topk)


@pytest.mark.parametrize("full_view", [False, True], ids=["used-slots", "full-view"])
def test_kv_bookkeeping_under_uneven_acceptance_matches_per_row_forwards(full_view):
    model = tiny_llama(vocab_size=VOCAB, seed=4, dtype=torch.float32, scale=4.0)
    prompts = _prompts()
    names = ["plain", "pld", "recycle", "stand", "pld", "recycling-80"]
    cfgs = [
        SamplingConfig(temperature=0.8, max_new_tokens=n, seed=i)
        for i, n in enumerate((40, 15, 40, 30, 8, 40))
    ]
    spy = _Spy(model, eos_ids=[], options=DecoderOptions(compact_slack=0, full_view=full_view))
    drafters = [_Recording(make_drafter(DRAFTER_CONFIGS[n], VOCAB), spy) for n in names]
    decode_rows(
        spy,
        [spy.new_row(p, d, c) for p, d, c in zip(prompts, drafters, cfgs, strict=True)],
        token_budget=60,
    )
    checked = 0
    for contexts, logits in spy.steps:
        for b, (tokens, tree) in enumerate(contexts):
            for node in range(tree.size):
                ref = model(torch.tensor([tokens + tree.path_tokens(node)])).logits[0, -1]
                torch.testing.assert_close(logits[b, node], ref, atol=1e-4, rtol=0)
                checked += 1
    assert len(spy.steps) > 20 and checked > 300


def test_rows_dropped_from_outside_a_step_after_the_cache_grew_keep_the_rest_exact(tiny_model):
    """The runner drops cancelled rows between steps (outside inference mode); the cache has
    reallocated its buffers inside a step by then. The rows left decode as they would alone."""
    prompts = _prompts()[:3]
    cfg = SamplingConfig(temperature=0, max_new_tokens=300)
    refs = [plain_generate(tiny_model, p, cfg, eos_ids=[]).token_ids for p in prompts]
    decoder = BatchDecoder(tiny_model, eos_ids=[])
    rows = [decoder.new_row(p, make_drafter(DRAFTER_CONFIGS["pld"], VOCAB), cfg) for p in prompts]
    decoder.join(rows)
    epoch = decoder.cache.epoch
    while decoder.cache.epoch == epoch:  # 256 slots at first: it grows within 300 tokens
        decoder.step(4)
    decoder.drop([rows[1]])
    while decoder.active:
        decoder.step(4)
    assert rows[0].result().token_ids == refs[0] and rows[2].result().token_ids == refs[2]
    assert len(rows[1].result().token_ids) < 300
