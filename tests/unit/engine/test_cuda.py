"""The verifier and the sampler on CUDA: probabilities, proposals, uniforms and the generator
all on the GPU (the exactness breach issue). Runs where a GPU is present."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tests.conftest import DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import decode_rows, generate
from tts_service.config import SamplingConfig
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.compact import CompactCausalLM
from tts_service.engine.decode import plain_generate
from tts_service.engine.options import DecoderOptions
from tts_service.engine.sampling import sample
from tts_service.engine.streams import Stream, stream_generator
from tts_service.engine.tree import DraftTree, SparseDist
from tts_service.engine.treepack import TreeBatch
from tts_service.engine.verify import verify_sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_sampling_on_the_gpu_is_exact():
    p = torch.tensor([0.1, 0.0, 0.4, 0.5], dtype=torch.float64, device="cuda")
    gen = stream_generator(0, Stream.VERIFY, "cuda")
    draws = [sample(p, gen) for _ in range(4000)]
    counts = [draws.count(t) for t in (0, 2, 3)]
    assert draws.count(1) == 0
    assert chisquare(counts, [400, 1600, 2000]).pvalue > 1e-3


def test_recursive_rejection_on_the_gpu_is_exact():
    """A root with two children drawn from q, verified against p, all on the GPU."""
    q = SparseDist((0, 1, 2), (0.6, 0.3, 0.1))
    p = torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=torch.float64, device="cuda")
    gen = stream_generator(1, Stream.VERIFY, "cuda")
    draft = stream_generator(1, Stream.DRAFT)  # the children: q without replacement, on the CPU
    qt = torch.tensor(q.probs, dtype=torch.float64)
    out = []
    for _ in range(4000):
        first, second = torch.multinomial(qt, 2, replacement=False, generator=draft).tolist()
        tree = DraftTree((9, first, second), (-1, 0, 0), (False, True, True), (q, None, None))
        out.append(verify_sampling(tree, p.expand(3, -1), gen).committed[0])
    counts = [out.count(t) for t in range(4)]
    assert chisquare(counts, [1200, 1200, 800, 800]).pvalue > 1e-3


@pytest.mark.parametrize("name", ["stand", "gtcp", "stand-dyn", "pld"])
def test_decoding_on_the_gpu(name):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    prompt = [5, 9, 12, 5, 9, 12, 5, 9]
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    ref = plain_generate(model, prompt, greedy, eos_ids=[]).token_ids
    drafter = make_drafter(DRAFTER_CONFIGS[name], 64)
    assert generate(model, prompt, drafter, greedy, eos_ids=[]).token_ids == ref
    sampled = SamplingConfig(temperature=0.8, max_new_tokens=24, seed=3)
    assert len(generate(model, prompt, drafter, sampled, eos_ids=[]).token_ids) == 24
    assert len(plain_generate(model, prompt, sampled, eos_ids=[]).token_ids) == 24


@pytest.mark.parametrize("name", ["plain", "stand", "pld", "recycle"])
def test_graphed_batches_are_token_identical_to_plain_greedy(name):
    """CUDA graphs of the verify forward (static cache, full view, padded buckets): every row of
    a batch, rows leaving at different lengths, commits what plain decoding commits alone."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    prompts = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4], [11]]
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=n) for n in (24, 9, 30, 17)]
    pairs = list(zip(prompts, cfgs, strict=True))
    refs = [plain_generate(model, p, c, eos_ids=[]).token_ids for p, c in pairs]
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    rows = [decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c) for p, c in pairs]
    results = decode_rows(decoder, rows, 24)
    assert [r.token_ids for r in results] == refs
    assert decoder.graphs is not None and decoder.graphs.enabled and decoder.graphs.graphs


@pytest.mark.parametrize("name", ["plain", "stand", "stand-dyn"])
def test_the_compact_forward_under_graphs_commits_plain_greedy(name):
    """The compact forward (`engine.compact`) captured in CUDA graphs, a GQA model so that its
    attention folds heads under the tree mask: every row commits what plain decoding does."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prompts = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=n) for n in (24, 9, 30)]
    pairs = list(zip(prompts, cfgs, strict=True))
    refs = [plain_generate(model, p, c, eos_ids=[]).token_ids for p, c in pairs]
    decoder = BatchDecoder(
        CompactCausalLM(model), eos_ids=[], options=DecoderOptions(compact_slack=0)
    )
    rows = [decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c) for p, c in pairs]
    assert [r.token_ids for r in decode_rows(decoder, rows, 24)] == refs
    assert decoder.graphs is not None and decoder.graphs.graphs


@pytest.mark.parametrize("name", ["plain", "pld", "stand-dyn", "stand"])
def test_graphed_acceptance_commits_what_the_eager_acceptance_commits(name):
    """The acceptance captured per bucket (`graphs.GraphedAcceptance`) beside the forward's
    graphs: greedy rows commit what plain decoding commits alone, and sampled rows the tokens
    the eager acceptance commits over the same forwards, rows leaving at different lengths
    (`stand`'s drawn children: the capture gathers what rule (c)'s host walk reads)."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    prompts = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4], [11]]
    lengths = (24, 9, 30, 17)
    greedy = [SamplingConfig(temperature=0, max_new_tokens=n) for n in lengths]
    pairs = zip(prompts, greedy, strict=True)
    refs = [plain_generate(model, p, c, eos_ids=[]).token_ids for p, c in pairs]
    sampled = [
        SamplingConfig(temperature=0.8, max_new_tokens=n, seed=i, top_p=0.9, top_k=20, min_p=0.05)
        for i, n in enumerate(lengths)
    ]

    def run(cfgs, graph_acceptance):
        decoder = BatchDecoder(
            model,
            eos_ids=[],
            options=DecoderOptions(compact_slack=0, graph_acceptance=graph_acceptance),
        )
        rows = [
            decoder.new_row(p, make_drafter(DRAFTER_CONFIGS[name], 64), c)
            for p, c in zip(prompts, cfgs, strict=True)
        ]
        return [r.token_ids for r in decode_rows(decoder, rows, 24)], decoder

    out, decoder = run(greedy, True)
    assert out == refs
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.enabled and graphs.captures > 0
    out, decoder = run(sampled, True)
    assert out == run(sampled, False)[0]
    graphs = decoder.accept_graphs
    assert graphs is not None and graphs.enabled and graphs.captures > 0
    assert bool(graphs.support_buffers) == (name == "stand")


def test_graphed_acceptance_is_captured_again_when_the_cache_grows():
    """A cache that starts small is reallocated mid-run (the forward's graphs are captured
    again, their logits buffers new): the acceptance's captures are dropped with them and
    captured again, and every row still commits what plain decoding commits."""
    from tts_service.engine.kv import StaticKV

    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    prompts = [[5, 9, 12] * 3, [7, 3, 7, 3, 7], [1, 2, 3, 4, 1, 2, 3, 4]]
    cfgs = [SamplingConfig(temperature=0, max_new_tokens=n) for n in (40, 30, 48)]
    pairs = list(zip(prompts, cfgs, strict=True))
    refs = [plain_generate(model, p, c, eos_ids=[]).token_ids for p, c in pairs]
    cache = StaticKV(model, capacity=16)
    decoder = BatchDecoder(
        model,
        eos_ids=[],
        cache=cache,
        options=DecoderOptions(compact_slack=0, graph_acceptance=True),
    )
    rows = [decoder.new_row(p, make_drafter(DRAFTER_CONFIGS["pld"], 64), c) for p, c in pairs]
    assert [r.token_ids for r in decode_rows(decoder, rows, 24)] == refs
    assert cache.epoch > 1 and decoder.accept_epoch == decoder.graphs.epoch
    assert decoder.accept_graphs.enabled and decoder.accept_graphs.captures > 0


def _graphed_step(decoder: BatchDecoder, rows: int, width: int) -> tuple[bool, torch.Tensor]:
    """One verify forward of `rows` chains of `width` tokens through the decoder's graphs;
    (whether its time may teach the cost surface, the logits)."""
    start = decoder.cache.length
    shape = decoder.graphs.bucket(rows, width)
    decoder.cache.reserve(shape[0], start + shape[1])
    trees = [DraftTree.chain(1, [1] * (width - 1))] * rows
    tb = TreeBatch.of(trees, width, decoder.device, [start] * rows)
    ids, pos, mask = decoder._pack(tb, shape)
    logits = decoder._forward(ids, pos, mask, start)
    return decoder.graphs.last_steady, logits


@torch.inference_mode()
def test_a_capturing_step_teaches_no_cost_and_a_reallocated_cache_captures_again():
    """The step that captures a bucket pays two warm-ups and the capture: not the bucket's cost
    (an H100 run taught its surface a 68 ms plain step that way, and trees looked 2x). After the
    cache is reallocated, with the old graphs' logits still held (their pool not yet freed),
    graphs are captured again in a new pool instead of failing the allocator's assert."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder.fill_random(2, 16)
    graphs = decoder.graphs
    assert [_graphed_step(decoder, 2, 1)[0] for _ in range(2)] == [False, True]
    assert [_graphed_step(decoder, 2, 4)[0] for _ in range(2)] == [False, True]
    assert (graphs.captures, graphs.eager_steps) == (2, 0)
    _, held = _graphed_step(decoder, 2, 1)
    epoch = decoder.cache.epoch
    decoder.cache.reserve(2, decoder.cache.capacity * 2)
    assert decoder.cache.epoch > epoch
    assert [_graphed_step(decoder, 2, 1)[0] for _ in range(2)] == [False, True]
    assert graphs.enabled and graphs.captures == 3
    assert held.isfinite().all()
    # past 1024 tokens a step runs eagerly for good: steady, never captured
    decoder.cache.reserve(2, decoder.cache.length + 640)
    assert [_graphed_step(decoder, 2, 640)[0] for _ in range(2)] == [True, True]
    assert (graphs.captures, graphs.eager_steps) == (3, 2)


@torch.inference_mode()
def test_a_capturing_step_runs_the_model_once_and_returns_its_own_logits():
    """The step that captures its bucket runs the model once eagerly (its warm-up, whose logits
    and KV writes are the step's) and once under capture (which runs nothing): not two warm-ups,
    the capture and a replay. Its logits equal the replay's over the same inputs."""
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0).to("cuda")
    decoder = BatchDecoder(model, eos_ids=[], options=DecoderOptions(compact_slack=0))
    decoder.fill_random(2, 16)
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        steady, captured = _graphed_step(decoder, 2, 4)
        captured = captured.clone()
        assert (steady, len(calls)) == (False, 2)
        steady, replayed = _graphed_step(decoder, 2, 4)
        assert (steady, len(calls)) == (True, 2)
    finally:
        hook.remove()
    torch.testing.assert_close(captured, replayed)
