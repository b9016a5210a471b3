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
from tts_service.engine.attention import NAME, grouped_sdpa, use_grouped_attention
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate


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
    decoder = BatchDecoder(copy.deepcopy(model), eos_ids=[], grouped_attention=True)
    assert decoder.model.config._attn_implementation == NAME
    rows = [
        decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c)
        for p, c in zip(prompts, cfgs, strict=True)
    ]
    assert [r.token_ids for r in decode_rows(decoder, rows, 24)] == refs
