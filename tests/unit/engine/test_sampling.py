"""`target_probs`, the one distribution plain and speculative decoding sample from: its filters
(top-k, top-p, min-p) by hand, and min-p through the speculative paths against the exact
distribution (chi-square, plus: a token min-p removed is never emitted)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import generate
from tts_service.config import SamplingConfig
from tts_service.engine.decode import plain_generate
from tts_service.engine.sampling import target_probs

P = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)


def _probs(**cfg) -> list[float]:
    out = target_probs(P.log(), SamplingConfig(temperature=1.0, **cfg))[0]
    return [round(x, 12) for x in out.tolist()]


def test_min_p_drops_tokens_below_its_share_of_the_top_token_and_renormalises():
    assert _probs(min_p=0.4) == [0.625, 0.375, 0.0, 0.0]  # 0.15 < 0.4 x 0.5
    assert _probs(min_p=0.0) == _probs()
    assert _probs(min_p=1.0) == [1.0, 0.0, 0.0, 0.0]  # only the top token


def test_min_p_applies_after_top_k_and_top_p_as_in_transformers():
    kept = [round(x / 0.95, 12) for x in (0.5, 0.3, 0.15)]
    assert _probs(top_k=3, min_p=0.05) == [*kept, 0.0]  # top-k drops 0.05; min-p nothing
    # top-p first keeps {0.5, 0.3, 0.15}; min-p then drops 0.15 (< 0.35 x 0.5)
    assert _probs(top_p=0.9, min_p=0.35) == [0.625, 0.375, 0.0, 0.0]


VOCAB = 12
PROMPT = [3, 7, 1, 3, 7, 1, 3, 7]  # repetitive, so drafts exist and get accepted
SAMPLES = 600
CFG = SamplingConfig(temperature=1.0, top_k=10, min_p=0.2, max_new_tokens=2)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=VOCAB, seed=11, scale=6.0)


@pytest.fixture(scope="module")
def exact(model) -> dict[tuple[int, int], float]:
    """P(t1, t2) under CFG, by enumerating every context."""
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([PROMPT])).logits[0, -1:], CFG)[0]
        p2 = target_probs(
            model(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1], CFG
        )
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def _check(samples: list[tuple[int, ...]], exact: dict) -> None:
    assert all(exact[s] > 0 for s in samples)  # nothing min-p removed is ever emitted
    counts = {k: samples.count(k) for k in exact}
    big = [k for k, p in exact.items() if p * len(samples) >= 5]
    rest = len(samples) - sum(counts[k] for k in big)
    exp = [exact[k] * len(samples) for k in big]
    pvalue = chisquare([counts[k] for k in big] + [rest], [*exp, len(samples) - sum(exp)]).pvalue
    assert pvalue > 1e-3, pvalue


@pytest.mark.statistical
def test_min_p_filters_the_target_distribution(exact):
    zeros = sum(p == 0 for p in exact.values())
    assert zeros > VOCAB  # the filter really removes tokens, beyond top-k's two per context


@pytest.mark.statistical
def test_plain_sampling_with_min_p_matches_the_exact_distribution(model, exact):
    cfgs = [CFG.model_copy(update={"seed": s}) for s in range(SAMPLES)]
    _check([tuple(plain_generate(model, PROMPT, c, eos_ids=[]).token_ids) for c in cfgs], exact)


@pytest.mark.statistical
@pytest.mark.parametrize("name", ["stand"])
def test_speculative_sampling_with_min_p_matches_the_exact_distribution(model, exact, name):
    drafter = make_drafter(DRAFTER_CONFIGS[name], VOCAB)
    samples, accepted = [], 0
    for seed in range(SAMPLES):
        res = generate(model, PROMPT, drafter, CFG.model_copy(update={"seed": seed}), eos_ids=[])
        samples.append(tuple(res.token_ids))
        accepted += res.stats.new_tokens - res.stats.target_forwards
    assert accepted > 0.05 * SAMPLES  # drafts were really verified, or this proves nothing
    _check(samples, exact)


@pytest.mark.statistical
def test_a_batched_row_with_min_p_matches_the_exact_distribution(model, exact):
    """The runner's path (Serve's): a row of a 2-row batch, its neighbour sampled without
    min-p."""
    from tests.engine_loop import decode_rows
    from tts_service.engine.batch import BatchDecoder

    decoder = BatchDecoder(model, eos_ids=[])
    drafters = [make_drafter(DRAFTER_CONFIGS[n], VOCAB) for n in ("stand", "recycle")]
    samples = []
    for seed in range(SAMPLES):
        cfgs = [
            CFG.model_copy(update={"seed": 2 * seed}),
            CFG.model_copy(update={"seed": 2 * seed + 1, "min_p": 0.0}),
        ]
        rows = [decoder.new_row(PROMPT, d, c) for d, c in zip(drafters, cfgs, strict=True)]
        samples.append(tuple(decode_rows(decoder, rows, 16)[0].token_ids))
    _check(samples, exact)


def test_softmax_in_place_is_softmax():
    """`softmax_` works in `x`'s own memory on a CPU (past `IN_PLACE_ENTRIES`) and agrees with
    torch's softmax, -inf (a filtered token) included."""
    from tts_service.engine.sampling import IN_PLACE_ENTRIES, softmax_

    x = torch.randn(2, 4, IN_PLACE_ENTRIES // 8, dtype=torch.float64) * 4
    x[0, 0, :10] = float("-inf")
    ref = torch.softmax(x, dim=-1)
    out = softmax_(x)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-15)
    assert (out[0, 0, :10] == 0).all()
