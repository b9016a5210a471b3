"""The captured acceptance on a CPU (`graphs.EagerReplayedAcceptance`): the same buckets, static
inputs and copies a GPU's graphs replay, each replay run eagerly. Every row must commit what it
commits through the eager acceptance: buffers reused across steps, rows leaving, buckets
changing, and the batches that must fall back (several sampling parameters, rule (c))."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows, plain_greedy
from tts_service.config import SamplingConfig
from tts_service.engine import acceptance as acceptance_module
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.graphs import EagerReplayedAcceptance, GraphedAcceptance, StepInputs
from tts_service.engine.options import DecoderOptions
from tts_service.engine.sampling import SamplingParams, store_probs
from tts_service.engine.streams import node_uniform_block
from tts_service.engine.tree import DraftTree
from tts_service.engine.treebatch import step_verdict, verdict
from tts_service.engine.treepack import TREE_BLOCKS, TreeBatch, tree_arrays

PROMPTS = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
LENGTHS = (24, 9, 30)
FILTERS = {"top_p": 0.9, "top_k": 20, "min_p": 0.05}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)


@pytest.fixture
def eager_steps(monkeypatch) -> list[int]:
    """Counts the steps whose acceptance ran eagerly (`treebatch.verdict` called by the decoder
    itself rather than inside a replay)."""
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return verdict(*args, **kwargs)

    monkeypatch.setattr(acceptance_module, "verdict", counted)
    return calls


def decode(
    decoder: BatchDecoder, name: str, temperatures: tuple[float, ...], filters=None, **fields
) -> list[list[int]]:
    cfgs = [
        SamplingConfig(temperature=t, max_new_tokens=n, seed=i, **(filters or {}))
        for i, (t, n) in enumerate(zip(temperatures, LENGTHS, strict=True))
    ]
    config = DRAFTER_CONFIGS[name].model_copy(update=fields)
    rows = [
        decoder.new_row(p, make_drafter(config, 64), c) for p, c in zip(PROMPTS, cfgs, strict=True)
    ]
    return [r.token_ids for r in decode_rows(decoder, rows, 24)]


def replayed(model) -> BatchDecoder:
    decoder = BatchDecoder(
        model, eos_ids=[], options=DecoderOptions(compact_slack=0, graph_acceptance=True)
    )
    assert isinstance(decoder.accept_graphs, EagerReplayedAcceptance)
    return decoder


@pytest.mark.parametrize("name", ["plain", "stand", "pld", "stand-dyn"])
def test_captured_greedy_acceptance_equals_plain_decoding(model, name, eager_steps):
    refs = plain_greedy(model, PROMPTS, LENGTHS)
    decoder = replayed(model)
    assert decode(decoder, name, (0.0,) * 3) == refs
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.enabled and graphs.captures > 0
    assert graphs.replay_s > 0  # type: ignore[attr-defined]
    assert eager_steps[0] == 0  # every step replayed (greedy trees have no sampled children)


@pytest.mark.parametrize("filters", [None, FILTERS], ids=["temperature", "top-p-k-min-p"])
@pytest.mark.parametrize("name", ["plain", "pld", "stand-dyn"])
def test_captured_sampled_acceptance_commits_the_eager_tokens(model, name, filters):
    """The same rows, seeds and trees through the captured and the eager acceptance: the same
    tokens (the uniforms are per row and node, so a bucket's pad rows change nothing), with
    temperature alone and with every filter of p."""
    eager = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder = replayed(model)
    out = decode(decoder, name, (0.8,) * 3, filters)
    assert out == decode(eager, name, (0.8,) * 3, filters)
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.captures > 0
    assert len(graphs.buffers) > 1  # rows leaving: more than one bucket


@pytest.mark.parametrize(
    "temperatures", [(0.8, 0.6, 0.8), (0.8, 0.0, 0.8)], ids=["two-temperatures", "greedy-beside"]
)
def test_batches_the_capture_cannot_serve_run_eagerly(model, temperatures, eager_steps):
    """Rows of several sampling parameters fall back to the eager acceptance, on the bucket's
    real rows, beside steps the capture serves (once the odd row has left): the same tokens."""
    eager = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder = replayed(model)
    out = decode(decoder, "stand-dyn", temperatures)
    fell_back = eager_steps[0]
    assert fell_back > 0
    assert out == decode(eager, "stand-dyn", temperatures)


@pytest.mark.parametrize(
    ("name", "fields"), [("stand", {}), ("stand-dyn", {"drawn": True})], ids=["stand", "drawn"]
)
def test_rows_walked_on_the_host_replay_the_capture_with_their_supports(
    model, name, fields, eager_steps
):
    """Trees with sampled children (rule (c), walked on the host): every step replays the
    capture that also gathers p on each node's support (`step_verdict_walked`), at a support
    width of its own; the rows commit what the eager acceptance, walking the dense p, commits."""
    eager = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder = replayed(model)
    out = decode(decoder, name, (0.8,) * 3, **fields)
    assert eager_steps[0] == 0
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.support_buffers  # walked steps were captured
    assert out == decode(eager, name, (0.8,) * 3, **fields)


def test_the_top_k_a_drafter_observes_outlives_the_reused_host_buffer(model, monkeypatch):
    """A replay's output comes back into one host buffer per shape (`to_host`), overwritten by
    the next step; the top-k every drafter observed (and keeps for its deferred observation)
    still reads, after the run, what it read at its own step."""
    seen: list[tuple[object, object, object]] = []
    from tts_service.drafters.stand_dyn_compiled import CompiledStandDyn

    observe = CompiledStandDyn.observe

    def kept(self, tree, acc, topk):
        seen.append((topk, topk.ids.copy(), topk.probs.copy()))
        return observe(self, tree, acc, topk)

    monkeypatch.setattr(CompiledStandDyn, "observe", kept)
    decoder = replayed(model)
    decode(decoder, "stand-dyn", (0.8,) * 3, drawn=True)
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.host_buffers and len(seen) > 10
    for topk, ids, probs in seen:
        assert (topk.ids == ids).all() and (topk.probs == probs).all()


def test_a_failed_capture_falls_back_to_the_eager_acceptance(model, caplog, monkeypatch):
    """A CUDA capture that fails (here: no stream can be made): the acceptance turns its graphs
    off with a warning and the rows commit what the eager acceptance commits."""

    def no_stream(*args, **kwargs):
        raise RuntimeError("no CUDA stream")

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    eager = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder.accept_graphs = GraphedAcceptance(decoder.device)
    with caplog.at_level(logging.WARNING):
        out = decode(decoder, "pld", (0.8,) * 3)
    assert out == decode(eager, "pld", (0.8,) * 3)
    assert not decoder.accept_graphs.enabled and decoder.accept_graphs.captures == 0
    assert "capture of the acceptance failed" in caplog.text


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_step_verdict_over_the_static_inputs_equals_the_eager_verdict(n, temperature):
    """What a capture replays: `step_verdict` over static buffers (`StepInputs`: the trees' ints
    and the uniforms in one block), refilled step after step with other trees (pad rows among
    them), equals `verdict` over a tree batch of the step's own (built without the buffers),
    greedy and sampled, plain steps and trees."""
    gen = torch.Generator().manual_seed(n)
    cfg = SamplingParams(temperature=temperature, **FILTERS)
    rows, vocab = 4, 16
    static = StepInputs.zeros(rows, n, torch.device("cpu"))
    assert static.ints.shape == (rows, TREE_BLOCKS * n) and static.uvw.shape == (rows, 3 * n)
    answers = []
    for step in range(3):
        shapes = [(-1, 0, 0, 1), (-1, 0, 1, 2)]
        trees = [
            DraftTree(
                (1, *torch.randint(0, vocab, (n - 1,), generator=gen).tolist()),
                shapes[(b + step) % 2][:n],
                (False,) * n,
                (None,) * n,
            )
            for b in range(rows - 1)
        ] + [DraftTree.root_only(0)]  # a bucket's pad row
        roots = [10 * step + b for b in range(rows - 1)] + [0]
        logits = torch.randn(rows, n, vocab, generator=gen) * 3
        keys, counters = [7 * b + 1 for b in range(rows)], [r + 1 for r in roots]
        block = node_uniform_block(keys, counters, n)
        static.fill(trees, roots, None if cfg.greedy else block)
        host = tree_arrays(trees, n, roots)
        assert torch.equal(static.ints, torch.from_numpy(host[0]))
        assert torch.equal(static.masks, torch.from_numpy(host[1]))
        if not cfg.greedy:
            assert torch.equal(static.uvw, torch.from_numpy(block))
        own = TreeBatch.of(trees, n, torch.device("cpu"), roots)
        uv = None if cfg.greedy else tuple(torch.from_numpy(block).split(n, 1)[:2])
        ref = verdict(own, logits, store_probs(logits, cfg), 5, uv)
        uvw = None if cfg.greedy else static.uvw
        got = step_verdict(cfg, 5, logits, static.ints, static.masks, uvw)
        assert torch.equal(got, ref)
        answers.append(got)
    assert not torch.equal(answers[0], answers[1])  # the refilled inputs were read


def test_captures_past_the_cap_run_eagerly(monkeypatch):
    """A new set of sampling parameters past `MAX_ACCEPTANCE_GRAPHS` is not captured (None: the
    caller runs it eagerly); the sets already captured still replay."""
    from tts_service.engine import graphs

    monkeypatch.setattr(graphs, "MAX_ACCEPTANCE_GRAPHS", 1)
    acc = EagerReplayedAcceptance(torch.device("cpu"))
    x = torch.arange(4.0)
    assert torch.equal(acc("a", lambda t: t * 2, (x,)), x * 2)
    assert acc("b", lambda t: t * 3, (x,)) is None
    y = x + 1
    want = y * 2
    assert torch.equal(acc("a", lambda t: t * 2, (y,)), want)  # copied into x, replayed
    assert torch.equal(x, y)
    assert acc.captures == 1


def test_the_acceptance_is_captured_by_default_only_beside_the_forwards_graphs(model):
    """`graph_acceptance` None (the default, `model.graph_acceptance: null`): on wherever the
    forward is captured, so off on a CPU; True runs the captured path eagerly there; False is
    the eager acceptance."""
    from tts_service.config import ModelConfig

    assert ModelConfig().graph_acceptance is None
    assert ModelConfig(graph_acceptance=False).graph_acceptance is False
    assert BatchDecoder(model, eos_ids=[]).accept_graphs is None
    assert (
        BatchDecoder(
            model, eos_ids=[], options=DecoderOptions(graph_acceptance=False)
        ).accept_graphs
        is None
    )
    on = BatchDecoder(
        model, eos_ids=[], options=DecoderOptions(graph_acceptance=True)
    ).accept_graphs
    assert isinstance(on, EagerReplayedAcceptance)
