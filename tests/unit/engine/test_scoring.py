"""`score_tokens`: the target's raw log-probabilities of given tokens, chunked."""

import pytest
import torch

from tests.conftest import tiny_llama
from tts_service.engine.scoring import score_tokens

IDS = [3, 17, 5, 42, 8, 8, 61, 0, 29, 11, 7]


def reference(model, ids):
    """Full logits of one forward: logp[i] is the distribution after ids[: i + 1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_logprobs_equal_one_full_forward_whatever_the_chunk(family, chunk):
    model = tiny_llama(vocab_size=64, seed=1, scale=4.0, family=family)
    ref = reference(model, IDS)
    got = score_tokens(model, IDS, start=0, top=3, chunk=chunk)
    assert got.logprobs[0] is None and got.top_ids[0] == [] and len(got.logprobs) == len(IDS)
    for i in range(1, len(IDS)):
        assert got.logprobs[i] == pytest.approx(ref[i - 1, IDS[i]].item(), abs=1e-9)
        values, indices = ref[i - 1].topk(3)
        assert got.top_ids[i] == indices.tolist()
        assert got.top_logprobs[i] == pytest.approx(values.tolist(), abs=1e-9)


def test_a_start_scores_only_the_tail_and_top_0_gives_no_alternatives():
    model = tiny_llama(vocab_size=64, seed=2, scale=4.0)
    full = score_tokens(model, IDS, start=0, top=2)
    tail = score_tokens(model, IDS, start=7, top=0)
    assert tail.logprobs == pytest.approx(full.logprobs[7:], abs=1e-12)
    assert tail.top_ids == [[]] * 4 and tail.top_logprobs == [[]] * 4
    assert score_tokens(model, IDS, start=len(IDS), top=2).logprobs == []
    assert score_tokens(model, [5], start=0, top=2).logprobs == [None]
    with pytest.raises(ValueError, match="start"):
        score_tokens(model, IDS, start=len(IDS) + 1, top=0)


def test_the_greedy_token_is_the_top_one_and_the_distribution_sums_to_one():
    model = tiny_llama(vocab_size=64, seed=3, scale=8.0)
    ids = [4]
    for _ in range(6):  # greedy continuation
        ids.append(int(reference(model, ids)[-1].argmax()))
    got = score_tokens(model, ids, start=1, top=64)
    for lp, top_ids, top_lp in zip(got.logprobs, got.top_ids, got.top_logprobs, strict=True):
        assert lp == top_lp[0]  # the token decoded greedily is the most likely one
        total = torch.tensor(top_lp, dtype=torch.float64).exp().sum().item()
        assert total == pytest.approx(1.0, abs=1e-9)
        assert sorted(top_ids) == list(range(64))


def test_each_chunk_of_the_forward_runs_through_the_caller_s_run():
    """A runner loop passes `between_steps`: the batch steps between two chunks."""
    model = tiny_llama(vocab_size=64, seed=1, scale=4.0)
    calls: list[int] = []

    def run(work):
        calls.append(1)
        return work()

    got = score_tokens(model, IDS, start=4, top=0, chunk=3, run=run)
    assert len(calls) == 4  # 10 positions, 3 at a time
    whole = score_tokens(model, IDS, start=4, top=0, chunk=256)
    assert got.logprobs == pytest.approx(whole.logprobs, abs=1e-9)
