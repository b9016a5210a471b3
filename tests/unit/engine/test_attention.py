"""Grouped tree attention (`engine.attention`): the same logits as transformers' SDPA with
`repeat_kv`, and the same tokens through the engine."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows
from tts_service.config import SamplingConfig
from tts_service.engine import attention
from tts_service.engine.attention import NAME, grouped_sdpa, tree_attention, use_grouped_attention
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions
from tts_service.engine.tree import ancestor_mask


class Heads(torch.nn.Module):
    num_key_value_groups = 3


def test_grouped_sdpa_equals_repeated_kv_with_a_tree_mask():
    gen = torch.Generator().manual_seed(0)
    r, kv, groups, n, k, d = 2, 2, 3, 5, 11, 8
    q = torch.randn(r, kv * groups, n, d, generator=gen, dtype=torch.float64)
    key = torch.randn(r, kv, k, d, generator=gen, dtype=torch.float64)
    value = torch.randn(r, kv, k, d, generator=gen, dtype=torch.float64)
    allowed = torch.rand(r, 1, n, k, generator=gen) < 0.6
    allowed[..., -1] = True  # every query sees at least one key
    mask = torch.zeros(r, 1, n, k, dtype=torch.float64).masked_fill_(~allowed, -1e30)
    out, _ = grouped_sdpa(Heads(), q, key, value, mask, scaling=0.3)
    rep_k = key.repeat_interleave(groups, dim=1)
    rep_v = value.repeat_interleave(groups, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, rep_k, rep_v, mask, scale=0.3)
    assert out.shape == (r, n, kv * groups, d)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_long_queries_and_unmasked_calls_take_transformers_path(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(a))
    q, kv = torch.zeros(1, 6, 4, 8), torch.zeros(1, 2, 4, 8)
    grouped_sdpa(Heads(), q, kv, kv, None)
    monkeypatch.setattr(attention, "MAX_FOLDED", 8)
    grouped_sdpa(Heads(), q, kv, kv, torch.zeros(1, 1, 4, 4))  # 3 × 4 > 8
    assert len(calls) == 2


def test_a_model_switched_to_grouped_attention_gives_the_same_logits():
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    grouped = copy.deepcopy(model)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == NAME
    ids = torch.tensor([[5, 9, 12, 5, 9, 12, 7]])
    mask = torch.zeros(1, 1, 7, 7).masked_fill_(~torch.ones(7, 7, dtype=torch.bool).tril(), -1e9)
    ref = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(grouped(ids, attention_mask=mask).logits, ref)
    eager = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    eager.config._attn_implementation = "eager"
    assert not use_grouped_attention(eager)


@pytest.mark.parametrize("name", ["stand", "stand-dyn"])
def test_grouped_attention_keeps_greedy_output_identical(name):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)
    prompts = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=n) for n in (24, 9, 30)]
    refs = [
        plain_generate(model, p, c, eos_ids=[]).token_ids
        for p, c in zip(prompts, cfgs, strict=True)
    ]
    decoder = BatchDecoder(
        copy.deepcopy(model), eos_ids=[], options=DecoderOptions(grouped_attention=True)
    )
    assert decoder.model.config._attn_implementation == NAME
    rows = [
        decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c)
        for p, c in zip(prompts, cfgs, strict=True)
    ]
    assert [r.token_ids for r in decode_rows(decoder, rows, 24)] == refs


def _reference(q, key, value, mask, scale):
    """fp64 attention written out: every query head against its KV head's keys repeated."""
    groups = q.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale + (0 if mask is None else mask)
    return scores.softmax(-1) @ v


def _tree_batch(gen, rows, context, parents, pad):
    """A `[rows, 1, n, context + n]` additive mask as the engine packs one: each row's own
    context length (`context - hole` valid slots, the rest blocked), then the tree's ancestor
    mask; the last `pad` nodes of a row are padding, which attend to their own slot only."""
    n = len(parents)
    mask = torch.full(
        (rows, 1, n, context + n), torch.finfo(torch.float64).min, dtype=torch.float64
    )
    anc = ancestor_mask(parents)
    for r in range(rows):
        hole = int(torch.randint(0, max(context // 2, 1), (1,), generator=gen))
        mask[r, 0, :, hole:context] = 0.0
        mask[r, 0, :, context:] = mask[r, 0, :, context:].masked_fill(anc, 0.0)
        for node in range(n - pad, n):
            mask[r, 0, node] = torch.finfo(torch.float64).min
            mask[r, 0, node, context + node] = 0.0
    return mask


@pytest.mark.parametrize("context", [1, 5, 2000])
@pytest.mark.parametrize(
    "parents",
    [(0,), (0, 0, 0, 1, 1, 2, 3), (0, 0, 1, 2, 3, 4, 5, 6)],
    ids=["root", "bushy", "chain"],
)
def test_tree_attention_equals_the_reference_in_float64(context, parents):
    gen = torch.Generator().manual_seed(context + len(parents))
    rows, kv, groups, d, n = 3, 2, 4, 16, len(parents)
    pad = 2 if n > 2 else 0
    q = torch.randn(rows, kv * groups, n, d, generator=gen, dtype=torch.float64)
    key = torch.randn(rows, kv, context + n, d, generator=gen, dtype=torch.float64)
    value = torch.randn(rows, kv, context + n, d, generator=gen, dtype=torch.float64)
    siblings = n > 2 and parents[1] == parents[2]
    if siblings:  # duplicate siblings: nodes 1 and 2 hold one token at one depth, so one key
        key[:, :, context + 2] = key[:, :, context + 1]
        value[:, :, context + 2] = value[:, :, context + 1]
        q[:, :, 2] = q[:, :, 1]
    mask = _tree_batch(gen, rows, context, parents, pad)
    out = tree_attention(q, key, value, mask, 0.25)
    torch.testing.assert_close(out, _reference(q, key, value, mask, 0.25), rtol=1e-12, atol=1e-12)
    if siblings:  # equal to rounding: the kernel may sum the two keys' lanes in other orders
        torch.testing.assert_close(out[:, :, 2], out[:, :, 1], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("groups", [1, 3])
def test_tree_attention_without_a_mask_and_for_long_masked_queries(groups, monkeypatch):
    """No mask (a plain step: SDPA's own GQA) and a query too long to fold (a prefill: the
    keys repeated) give the reference too."""
    gen = torch.Generator().manual_seed(groups)
    q = torch.randn(2, 2 * groups, 6, 8, generator=gen, dtype=torch.float64)
    key = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 2, 6, 8, generator=gen, dtype=torch.float64)
    causal = torch.zeros(1, 1, 6, 6, dtype=torch.float64).masked_fill_(
        ~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo(torch.float64).min
    )
    unmasked = tree_attention(q, key, value, None, 0.5)
    torch.testing.assert_close(unmasked, _reference(q, key, value, None, 0.5))
    monkeypatch.setattr(attention, "MAX_FOLDED", 4)  # 6 · G > 4: not folded
    assert not attention.foldable(q, key, causal)
    long = tree_attention(q, key, value, causal, 0.5)
    torch.testing.assert_close(long, _reference(q, key, value, causal, 0.5))
