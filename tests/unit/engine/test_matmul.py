"""The per-shape product choice computes what `nn.Linear` computes, and speculative decoding
stays token-identical to plain decoding with it forced on for every row count."""

from __future__ import annotations

import json

import torch
from torch import nn

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import generate
from tts_service.config import SamplingConfig
from tts_service.engine.decode import plain_generate
from tts_service.engine.matmul import _Choice, faster_transposed_rows, tune_linear_products


def test_the_transposed_product_equals_linear_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (True, False):
        layer = nn.Linear(24, 40, bias=bias).double()
        wrapped = _Choice(layer, frozenset(range(1, 64)))
        for shape in ((1, 24), (3, 24), (2, 5, 24), (1, 1, 24)):
            x = torch.randn(shape, dtype=torch.float64)
            torch.testing.assert_close(wrapped(x), layer(x), atol=1e-12, rtol=0)


def test_tuning_picks_rows_from_timings_and_can_undo():
    model = tiny_llama(vocab_size=32, seed=1)
    choice = tune_linear_products(model)
    assert set(choice) == {
        tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)
    }
    assert all(set(rows) <= set(range(1, 33)) for rows in choice.values())
    rows = faster_transposed_rows(model.lm_head.weight, rows=(1, 2), repeats=1)
    assert rows <= {1, 2}


def test_the_choices_are_kept_on_disk_and_not_timed_again(tmp_path, monkeypatch):
    import tts_service.engine.matmul as matmul

    cache = tmp_path / "matmul.json"
    model = tiny_llama(vocab_size=32, seed=1)
    first = tune_linear_products(model, cache)
    timed = []
    monkeypatch.setattr(matmul, "faster_transposed_rows", lambda w: timed.append(w) or {2})
    assert tune_linear_products(model, cache) == first and timed == []
    cache.write_text("[not a dict of shapes]")
    tune_linear_products(model, cache)  # unreadable: timed again, and rewritten
    assert timed and json.loads(cache.read_text())


def test_greedy_stays_token_identical_with_the_transposed_product_everywhere():
    model = tiny_llama(vocab_size=64, seed=0, scale=8.0)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.forward = _Choice(layer, frozenset(range(1, 4096)))
    prompt = [5, 9, 12, 5, 9, 12, 5, 9]
    cfg = SamplingConfig(temperature=0, max_new_tokens=30)
    ref = plain_generate(model, prompt, cfg, eos_ids=[]).token_ids
    for name in ("pld", "stand", "recycle", "gtcp"):
        drafter = make_drafter(DRAFTER_CONFIGS[name], 64)
        res = generate(model, prompt, drafter, cfg, eos_ids=[])
        assert res.token_ids == ref, name
        assert res.stats.acceptance_length > 1.2, name
