"""The captured acceptance on a CPU (`graphs.EagerReplayedAcceptance`): the same buckets, static
inputs and copies a GPU's graphs replay, each replay run eagerly. Every row must commit what it
commits through the eager acceptance: buffers reused across steps, rows leaving, buckets
changing, and the batches that must fall back (several sampling parameters, rule (c))."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows
from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.decode import plain_generate
from tts_service.engine.graphs import EagerReplayedAcceptance, GraphedAcceptance
from tts_service.engine.treebatch import (
    TREE_BLOCKS,
    TreeBatch,
    step_verdict,
    tree_arrays,
    verdict,
)

PROMPTS = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
LENGTHS = (24, 9, 30)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)


def decode(
    decoder: BatchDecoder, name: str, temperatures: tuple[float, ...], **fields
) -> list[list[int]]:
    cfgs = [
        SamplingConfig(temperature=t, max_new_tokens=n, seed=i)
        for i, (t, n) in enumerate(zip(temperatures, LENGTHS, strict=True))
    ]
    config = DRAFTER_CONFIGS[name].model_copy(update=fields)
    rows = [
        decoder.new_row(p, make_drafter(config, 64), c) for p, c in zip(PROMPTS, cfgs, strict=True)
    ]
    return [r.token_ids for r in decode_rows(decoder, rows, 24)]


def replayed(model) -> BatchDecoder:
    decoder = BatchDecoder(model, eos_ids=[], compact_slack=0, graph_acceptance=True)
    assert isinstance(decoder.accept_graphs, EagerReplayedAcceptance)
    return decoder


@pytest.mark.parametrize("name", ["plain", "stand", "pld", "stand-dyn"])
def test_captured_greedy_acceptance_equals_plain_decoding(model, name):
    refs = [
        plain_generate(
            model, p, SamplingConfig(temperature=0, max_new_tokens=n), eos_ids=[]
        ).token_ids
        for p, n in zip(PROMPTS, LENGTHS, strict=True)
    ]
    decoder = replayed(model)
    assert decode(decoder, name, (0.0,) * 3) == refs
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.enabled and graphs.captures > 0
    assert graphs.replay_s > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["plain", "pld", "stand-dyn"])
def test_captured_sampled_acceptance_commits_the_eager_tokens(model, name):
    """The same rows, seeds and trees through the captured and the eager acceptance: the same
    tokens (the uniforms are per row and node, so a bucket's pad rows change nothing)."""
    eager = BatchDecoder(model, eos_ids=[], compact_slack=0)
    decoder = replayed(model)
    assert decode(decoder, name, (0.8,) * 3) == decode(eager, name, (0.8,) * 3)
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.captures > 0
    assert len(graphs.buffers) > 1  # rows leaving: more than one bucket


@pytest.mark.parametrize(
    ("temperatures", "fields"),
    [((0.8, 0.6, 0.8), {}), ((0.8, 0.0, 0.8), {}), ((0.8,) * 3, {"drawn": True})],
    ids=["two-temperatures", "greedy-beside-sampled", "drawn-children"],
)
def test_batches_the_capture_cannot_serve_run_eagerly(model, temperatures, fields):
    """Rows of several sampling parameters, and trees with sampled children (the host walks
    them, rule (c)), fall back to the eager acceptance, on the bucket's real rows, beside steps
    the capture serves (once the odd row has left, or a step drew nothing): the same tokens."""
    eager = BatchDecoder(model, eos_ids=[], compact_slack=0)
    decoder = replayed(model)
    out = decode(decoder, "stand-dyn", temperatures, **fields)
    assert out == decode(eager, "stand-dyn", temperatures, **fields)


def test_a_failed_capture_falls_back_to_the_eager_acceptance(model, caplog):
    """A real CUDA capture on a CPU fails: the acceptance turns its graphs off with a warning and
    the rows commit what the eager acceptance commits."""
    eager = BatchDecoder(model, eos_ids=[], compact_slack=0)
    decoder = BatchDecoder(model, eos_ids=[], compact_slack=0)
    decoder.accept_graphs = GraphedAcceptance(decoder.device)
    with caplog.at_level(logging.WARNING):
        out = decode(decoder, "pld", (0.8,) * 3)
    assert out == decode(eager, "pld", (0.8,) * 3)
    assert not decoder.accept_graphs.enabled and decoder.accept_graphs.captures == 0
    assert "capture of the acceptance failed" in caplog.text


def test_step_verdict_reads_only_its_inputs():
    """What a capture replays: `step_verdict` over the static inputs equals `verdict` over the
    batch's own tensors, and refilling the inputs (the next step's trees) changes its answer
    as it changes the eager one."""
    from tts_service.engine.sampling import SamplingParams, store_probs
    from tts_service.engine.tree import DraftTree

    gen = torch.Generator().manual_seed(0)
    cfg = SamplingParams(temperature=0.7)
    rows, n, vocab = 4, 4, 16
    ints = torch.zeros(rows, TREE_BLOCKS * n, dtype=torch.long)
    masks = torch.zeros(2, rows, n, n, dtype=torch.bool)
    uvw = torch.zeros(rows, 3 * n, dtype=torch.float64)
    for step in range(3):
        trees = [
            DraftTree(
                (1, *torch.randint(0, vocab, (3,), generator=gen).tolist()),
                (-1, 0, 0, 1) if step % 2 else (-1, 0, 1, 2),
                (False,) * 4,
                (None,) * 4,
            )
            for _ in range(rows)
        ]
        logits = torch.randn(rows, n, vocab, generator=gen) * 3
        uvw.copy_(torch.rand(rows, 3 * n, generator=gen, dtype=torch.float64))
        roots = [10 * step + b for b in range(rows)]
        tb = TreeBatch.of(trees, n, torch.device("cpu"), roots, (ints, masks))
        host = tree_arrays(trees, n, roots)
        assert torch.equal(ints, torch.from_numpy(host[0]))
        assert torch.equal(masks, torch.from_numpy(host[1]))
        u, v, _ = uvw.split(n, 1)
        ref = verdict(tb, logits, store_probs(logits, cfg), 5, (u, v))
        assert torch.equal(step_verdict(cfg, 5, logits, ints, masks, uvw), ref)
