"""The compact forward equals transformers' forward (fp32, 1e-5) for tiny Llama and Qwen2
models, eager and compiled: a left-padded prefill, one token, a tree under its 4-D mask, and a
padded bucket, the caches it writes included; other families are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import tiny_llama
from tts_service.engine.compact import CompactCausalLM, supports
from tts_service.engine.tree import DraftTree, ancestor_mask

ATOL = 1e-5


def additive(allowed: torch.Tensor) -> torch.Tensor:
    """`[R, N, K]` bool -> the engine's `[R, 1, N, K]` additive float32 mask."""
    zero = torch.zeros((), dtype=torch.float32)
    return zero.where(allowed, torch.finfo(torch.float32).min)[:, None]


def prefill_inputs(prompts: list[list[int]]):
    """Left-padded ids, positions and mask, as `BatchDecoder._prefill` builds them."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    pos = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        pos[b, width - len(p) :] = torch.arange(len(p))
        valid[b, width - len(p) :] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
    return ids, pos, additive(allowed), valid


def both(model, compact, *args, **kwargs):
    """The two forwards on the same inputs, each with its own copy of `cache` (or None)."""
    cache = kwargs.pop("cache", None)
    caches = [None, None] if cache is None else [_copy(cache), _copy(cache)]
    with torch.inference_mode():
        a = model(*args, past_key_values=caches[0], **kwargs).logits
        b = compact(*args, past_key_values=caches[1], **kwargs).logits
    return a, b, caches


def _copy(cache: DynamicCache) -> DynamicCache:
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


@pytest.fixture(params=["llama", "qwen2", "llama-compiled"])
def models(request):
    """(transformers' model, the compact forward over a copy of its weights); `-compiled`:
    the compact forward's kernels compiled (`CompactCausalLM.compile`)."""
    family = request.param.removesuffix("-compiled")
    model = tiny_llama(vocab_size=64, seed=3, dtype=torch.float32, family=family)
    if family == "qwen2":  # Qwen2's QKV biases are zeros at init: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0, 0.5)
    reference = tiny_llama(vocab_size=64, seed=3, dtype=torch.float32, family=family)
    reference.load_state_dict(model.state_dict())
    compact = CompactCausalLM(model)
    if request.param.endswith("-compiled"):
        compact.compile()
        assert compact.compiled
    return reference, compact


def test_prefill_one_token_and_a_tree_equal_transformers(models):
    model, compact = models
    ids, pos, mask, valid = prefill_inputs([[5, 9, 2, 7, 1], [3, 3, 8]])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    a, b, _ = both(model, compact, ids, attention_mask=mask, position_ids=pos)
    assert torch.allclose(a, b, atol=ATOL)

    one = torch.tensor([[4], [6]])  # one token a row after the prefill
    allowed = torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], dim=1)[:, None]
    step = additive(allowed)
    args = (one,)
    a, b, caches = both(
        model, compact, *args, attention_mask=step, position_ids=pos[:, -1:] + 1, cache=cache
    )
    assert torch.allclose(a, b, atol=ATOL)
    for la, lb in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.allclose(la.keys, lb.keys, atol=ATOL)
        assert torch.allclose(la.values, lb.values, atol=ATOL)

    tree = DraftTree((4, 1, 2, 1, 9), (-1, 0, 0, 1, 1), (False,) * 5, (None,) * 5)
    n = tree.size
    anc = ancestor_mask(tree.parents)
    allowed = torch.cat([valid[:, None, :].expand(2, n, -1), anc[None].expand(2, n, n)], dim=2)
    ids = torch.tensor([tree.tokens] * 2)
    depths = torch.tensor([tree.depths] * 2) + pos[:, -1:] + 1
    a, b, _ = both(
        model, compact, ids, attention_mask=additive(allowed), position_ids=depths, cache=cache
    )
    assert torch.allclose(a, b, atol=ATOL)


def test_a_padded_bucket_and_logits_to_keep(models):
    model, compact = models
    ids, pos, mask, _ = prefill_inputs([[5, 9, 2], [3]])
    blocked = torch.finfo(torch.float32).min
    pad = torch.full((2, 1, 4, 4), blocked)  # the bucket's pad node attends to itself alone
    pad[:, :, :3, :3] = mask
    pad[:, :, 3, 3] = 0.0
    ids = torch.cat([ids, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    pos = torch.cat([pos, torch.zeros(2, 1, dtype=torch.long)], dim=1)
    a, b, _ = both(model, compact, ids, attention_mask=pad, position_ids=pos, logits_to_keep=2)
    assert a.shape == b.shape == (2, 2, 64) and torch.allclose(a, b, atol=ATOL)


def test_a_family_it_does_not_cover_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    assert not supports(gpt2)
    with pytest.raises(ValueError, match="no compact forward"):
        CompactCausalLM(gpt2)


def test_its_own_causal_mask_over_a_cache_equals_transformers(models):
    """No mask given (plain decoding's calls): causal over the cache and the new tokens."""
    model, compact = models
    with torch.inference_mode():
        caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
        for ids in ([[5, 9, 2, 7]], [[4]], [[8, 1]]):
            a = model(torch.tensor(ids), past_key_values=caches[0]).logits
            b = compact(torch.tensor(ids), past_key_values=caches[1]).logits
            assert torch.allclose(a, b, atol=ATOL)


def test_the_runner_over_the_compact_forward_commits_plain_greedy(tiny_model, drafter_config):
    """Every method, rows joining and leaving: token-identical to transformers' plain greedy."""
    import copy

    from store.memory import InMemoryNgramStore
    from tests.unit.test_runner import _prompts, make_generator
    from tts_service.config import SamplingConfig
    from tts_service.engine.decode import plain_generate
    from tts_service.runner import TrajectoryRunner
    from tts_service.trajectory import TrajectoryRequest

    gen = make_generator(CompactCausalLM(copy.deepcopy(tiny_model)))
    requests, refs = [], []
    for p, prompt in enumerate(_prompts()):
        store = InMemoryNgramStore()
        for i in range(2):
            cfg = SamplingConfig(temperature=0, max_new_tokens=6 + 7 * ((p + i) % 4), seed=i)
            requests.append(TrajectoryRequest(f"p{p}", i, prompt, cfg, drafter_config, store))
            refs.append(plain_generate(tiny_model, prompt, cfg, eos_ids=[]).token_ids)
    report = TrajectoryRunner(gen, 3).run(requests)
    got = {(r.request.problem_id, r.request.index): r.output.token_ids for r in report.results}
    assert [got[r.problem_id, r.index] for r in requests] == refs
