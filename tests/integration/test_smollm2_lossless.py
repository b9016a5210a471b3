"""Greedy losslessness on the real SmolLM2-135M: 3 prompts x 128 new tokens, every drafter."""

from __future__ import annotations

import pytest
import torch

from tts_service.config import SamplingConfig
from tts_service.drafters.goose import GooseDrafterConfig
from tts_service.drafters.pld import PldDrafterConfig
from tts_service.drafters.recycling import RecyclingDrafterConfig
from tts_service.engine.decode import plain_generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "List the first twelve prime numbers, then list them again in reverse order.",
    "Write a Python function that checks whether a string is a palindrome, then test it "
    "on three examples.",
    "Solve step by step: a rectangle has perimeter 30 and length 9. What is its area?",
]
GREEDY = SamplingConfig(temperature=0, max_new_tokens=128, ignore_eos=True)
DRAFTERS = [PldDrafterConfig(), RecyclingDrafterConfig(num_nodes=16), GooseDrafterConfig()]


@pytest.fixture(scope="module")
def references(smollm2):
    model = smollm2.loaded.model
    refs = []
    for prompt in PROMPTS:
        ids = smollm2.encode(prompt, chat=True)
        ref = plain_generate(model, ids, GREEDY, eos_ids=[])
        t = torch.tensor([ids])
        hf = model.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=128,
            min_new_tokens=128,
            do_sample=False,
            pad_token_id=smollm2.loaded.eos_token_ids[0],
        )[0, len(ids) :].tolist()
        assert list(ref.token_ids) == hf
        refs.append((ids, ref.token_ids))
    return refs


@pytest.mark.parametrize("drafter", DRAFTERS, ids=lambda d: d.kind)
def test_smollm2_greedy_is_token_identical(smollm2, references, drafter):
    """Through the runner, every step drafting (a fixed budget, not the cost surface's)."""
    from store.memory import InMemoryNgramStore
    from tts_service.runner import TrajectoryRunner
    from tts_service.trajectory import trajectory_requests

    runner = TrajectoryRunner(smollm2, 1, "fixed", token_budget=1025)
    forwards = tokens = 0
    for ids, ref in references:
        store = InMemoryNgramStore()
        (res,) = runner.run(trajectory_requests("q", ids, [0], GREEDY, drafter, store)).results
        out = res.output
        assert out.token_ids == ref
        forwards += out.stats.target_forwards
        tokens += out.stats.new_tokens
    assert tokens / forwards > 1.1  # the drafts were really used


def test_cli_generate_json(smollm2, capsys):
    """The documented command, end to end in-process."""
    import json

    from tts_service.cli import main

    rc = main(
        [
            "generate",
            "--model",
            "smollm2-135m",
            "--method",
            "pld",
            "--temperature",
            "0",
            "--max-new-tokens",
            "24",
            "--chat",
            "--json",
            "What is the capital of France?",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and "Paris" in out["text"]
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    for key in (
        "new_tokens",
        "target_forwards",
        "acceptance_length",
        "draft_s",
        "verify_s",
        "wall_s",
        "tokens_per_s",
        "setup_s",
        "decode_s",
        "decode_tokens_per_s",
    ):
        assert key in out["stats"]
    assert 0 < out["stats"]["decode_s"] < out["stats"]["wall_s"]  # the wall since the start
