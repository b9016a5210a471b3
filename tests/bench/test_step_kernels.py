"""bench.step_kernels on a CPU: both attentions, every cell timed, the profiled cells' ops."""

from __future__ import annotations

import torch

from bench import step_kernels
from tests.conftest import tiny_llama
from tts_service.engine.attention import NAME as GROUPED


@torch.inference_mode()
def test_step_kernels_times_every_cell_and_restores_the_attention():
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    records = step_kernels.measure(model, 2, [1, 4], [16])
    timed = [r for r in records if "kernels" not in r]
    assert [(r["attention"], r["width"]) for r in timed] == [
        ("sdpa", 1),
        ("sdpa", 4),
        (GROUPED, 1),
        (GROUPED, 4),
    ]
    assert all(r["graph_ms"] > 0 and r["eager_ms"] > 0 for r in timed)
    profiled = [r for r in records if "kernels" in r]
    assert len(profiled) == 4
    for r in profiled:
        shares = [share for _, _, share in r["kernels"]]
        assert r["kernels"] and shares == sorted(shares, reverse=True) and sum(shares) <= 1.0001
    assert model.config._attn_implementation == "sdpa"
