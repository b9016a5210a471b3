"""Greedy losslessness: every drafter commits exactly what plain decoding and HF generate do,
also on a vocabulary smaller than the store's top-k."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import COPYING_KINDS, DRAFTER_CONFIGS, make_drafter, tiny_llama
from tests.engine_loop import generate
from tts_service.config import SamplingConfig
from tts_service.engine.decode import plain_generate

NEW = 40


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(24):
        base = torch.randint(3, 64, (4 + i % 5,), generator=gen).tolist()
        # every other prompt repeats itself, so drafts get accepted for real
        out.append(
            base * 3 if i % 2 == 0 else base + torch.randint(3, 64, (6,), generator=gen).tolist()
        )
    out.append([5])  # a one-token prompt: nothing to prefill
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def references(tiny_model):
    cfg = SamplingConfig(temperature=0, max_new_tokens=NEW)
    refs = []
    for prompt in PROMPTS:
        ref = plain_generate(tiny_model, prompt, cfg, eos_ids=[])
        ids = torch.tensor([prompt])
        # a) explicit attention mask: HF would otherwise mask prompt tokens equal to pad_token_id
        hf = tiny_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert list(ref.token_ids) == hf
        refs.append(ref.token_ids)
    return refs


def test_every_drafter_is_token_identical_to_plain_greedy(tiny_model, drafter_config, references):
    cfg = SamplingConfig(temperature=0, max_new_tokens=NEW)
    drafter = make_drafter(drafter_config, tiny_model.config.vocab_size)
    accepted_on_repetitive = []
    for i, (prompt, ref) in enumerate(zip(PROMPTS, references, strict=True)):
        res = generate(tiny_model, prompt, drafter, cfg, eos_ids=[])
        assert res.token_ids == ref, f"prompt {i} diverged"
        assert res.finish_reason == "length" and res.stats.new_tokens == NEW
        if i % 2 == 0:
            accepted_on_repetitive.append(res.stats.acceptance_length)
    mean = sum(accepted_on_repetitive) / len(accepted_on_repetitive)
    if drafter_config.kind == "plain":
        assert mean == 1.0
    elif drafter_config.kind == "ptd":  # self-drafting: it does not copy the repeated prompt
        assert mean > 1.15, mean
    else:  # a family not known to copy (a new one): some draft accepted, not all rejected
        assert mean > (1.3 if drafter_config.kind in COPYING_KINDS else 1.0), mean


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13])
def test_max_new_tokens_cuts_inside_an_accepted_block(tiny_model, drafter_config, max_new):
    cfg = SamplingConfig(temperature=0, max_new_tokens=max_new)
    prompt = PROMPTS[0]
    ref = plain_generate(tiny_model, prompt, cfg, eos_ids=[])
    res = generate(tiny_model, prompt, make_drafter(drafter_config, 64), cfg, eos_ids=[])
    assert res.token_ids == ref.token_ids and len(res.token_ids) == max_new
    assert res.finish_reason == "length"


def test_eos_cuts_inside_an_accepted_block(tiny_model, drafter_config, references):
    cfg = SamplingConfig(temperature=0, max_new_tokens=NEW)
    for prompt, ref in list(zip(PROMPTS, references, strict=True))[:12:2]:
        eos = ref[len(ref) // 2]  # a token the model really emits mid-stream
        expect = plain_generate(tiny_model, prompt, cfg, eos_ids=[eos])
        res = generate(tiny_model, prompt, make_drafter(drafter_config, 64), cfg, eos_ids=[eos])
        assert res.token_ids == expect.token_ids and res.token_ids[-1] == eos
        assert res.finish_reason == "stop"


def test_stop_strings_cut_like_plain_decoding(tiny_model, drafter_config, references):
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("A") + i % 26) + chr(ord("a") + i // 26) for i in ids)

    prompt, ref = PROMPTS[2], references[2]
    stop = decode(list(ref[9:11]))  # two tokens that really occur
    cfg = SamplingConfig(temperature=0, max_new_tokens=NEW, stop=(stop,))
    expect = plain_generate(tiny_model, prompt, cfg, eos_ids=[], decode=decode)
    res = generate(tiny_model, prompt, make_drafter(drafter_config, 64), cfg, [], decode)
    assert res.token_ids == expect.token_ids and res.stop_text == stop
    assert len(res.token_ids) <= 11 and res.finish_reason == "stop"


VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_llama(vocab_size=VOCAB, seed=2, scale=4.0)


@pytest.mark.parametrize("name", sorted(DRAFTER_CONFIGS))
def test_a_vocabulary_of_8_tokens_runs_through_every_drafter(small_vocab_model, name):
    prompt = [1, 5, 3, 1, 5, 3, 1]
    greedy = SamplingConfig(temperature=0, max_new_tokens=24)
    ref = plain_generate(small_vocab_model, prompt, greedy, eos_ids=[])
    drafter = make_drafter(DRAFTER_CONFIGS[name], VOCAB)
    assert generate(small_vocab_model, prompt, drafter, greedy, eos_ids=[]).token_ids == (
        ref.token_ids
    )
    sampled = SamplingConfig(temperature=0.8, max_new_tokens=24, seed=3)
    res = generate(small_vocab_model, prompt, drafter, sampled, eos_ids=[])
    assert len(res.token_ids) == 24 and all(0 <= t < VOCAB for t in res.token_ids)


def test_decoding_prints_no_past_key_values_deprecation():
    """transformers >= 5.24 warns on every forward given `past_key_values`; the engine (which
    passes it, as every transformers 5.x accepts) silences that one warning."""
    import subprocess
    import sys

    code = (
        "from tests.conftest import tiny_llama\n"
        "from tts_service.config import SamplingConfig\n"
        "from tts_service.engine.decode import plain_generate\n"
        "cfg = SamplingConfig(temperature=0, max_new_tokens=2)\n"
        "plain_generate(tiny_llama(), [1, 2, 3], cfg, eos_ids=[])\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, check=True
    )
    assert "past_key_values" not in out.stderr
