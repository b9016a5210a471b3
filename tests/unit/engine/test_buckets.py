"""Graph buckets on a CPU: the padded (rows, tokens) shapes a GPU's captured verify forward
runs at, run eagerly, so the padding is checked where no GPU is. Pad rows and pad tokens must
change nothing a row commits."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows, plain_greedy
from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.graphs import GraphedForward
from tts_service.engine.options import DecoderOptions

PROMPTS = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
LENGTHS = (24, 9, 30)


class EagerBuckets(GraphedForward):
    """A GPU's buckets without its graphs: every step padded, then run eagerly."""

    def _capture(self, ids, pos, mask, slots):
        self.padded = getattr(self, "padded", 0) + 1
        return None


def bucketed(model) -> BatchDecoder:
    decoder = BatchDecoder(
        model,
        eos_ids=[],
        options=DecoderOptions(compact_slack=0, cuda_graphs=False, full_view=True),
    )
    decoder.graphs = EagerBuckets(model, decoder.cache)
    return decoder


def decode(decoder: BatchDecoder, name: str, temperature: float) -> list[list[int]]:
    cfgs = [
        SamplingConfig(temperature=temperature, max_new_tokens=n, seed=i)
        for i, n in enumerate(LENGTHS)
    ]
    rows = [
        decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c)
        for p, c in zip(PROMPTS, cfgs, strict=True)
    ]
    return [r.token_ids for r in decode_rows(decoder, rows, 24)]


@pytest.mark.parametrize("name", ["stand", "pld", "recycle", "stand-dyn"])
def test_bucket_padded_greedy_batches_equal_plain_decoding(name):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)
    refs = plain_greedy(model, PROMPTS, LENGTHS)
    decoder = bucketed(model)
    assert decode(decoder, name, 0.0) == refs
    assert decoder.graphs.padded > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["stand", "stand-dyn"])
def test_bucket_padding_changes_no_sampled_token(name):
    """The same rows, seeds and trees with and without padding: the same tokens."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)
    plain = BatchDecoder(
        model,
        eos_ids=[],
        options=DecoderOptions(compact_slack=0, cuda_graphs=False, full_view=True),
    )
    assert decode(bucketed(model), name, 0.8) == decode(plain, name, 0.8)


def test_time_forward_pads_to_the_bucket():
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    decoder = bucketed(model)
    decoder.fill_random(3, 16)
    assert decoder.time_forward(3, 5) > 0  # 3 × 5 runs as 4 × 8
    assert decoder.cache.length == 16
