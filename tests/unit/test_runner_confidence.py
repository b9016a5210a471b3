"""Each trajectory's confidence from the runner: DeepConf's summary of the target's top-k at
every committed token, the same as computed from the recorded top-k, and the same output with
or without it (it only reads what the verifier already holds)."""

from __future__ import annotations

import pytest

from store.memory import InMemoryNgramStore
from tests.unit.test_runner import _prompts, make_generator
from tts_service.aggregate.confidence import token_confidence, trajectory_confidence
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DRAFTER_CONFIGS
from tts_service.runner import TrajectoryRunner
from tts_service.trajectory import TrajectoryRequest


@pytest.mark.parametrize("method", ["plain", "stand"])
def test_confidence_is_the_recorded_top_k_s_and_changes_no_token(tiny_model, method):
    cfg = SamplingConfig(temperature=0.8, max_new_tokens=24, seed=3)

    def run(record: bool, confidence: bool):  # a fresh model's ledger: the same seeds again
        gen, store = make_generator(tiny_model), InMemoryNgramStore()
        requests = [
            TrajectoryRequest(
                "p", i, _prompts()[1], cfg, DRAFTER_CONFIGS[method](), store, record,
                confidence=confidence,
            )
            for i in range(2)
        ]  # fmt: skip
        report = TrajectoryRunner(gen, 2).run(requests)
        return sorted(report.results, key=lambda r: r.request.index)

    both, plain = run(True, True), run(False, False)
    only = run(False, True)
    for b, p, o in zip(both, plain, only, strict=True):
        assert b.output.token_ids == p.output.token_ids == o.output.token_ids
        assert p.confidence is None and o.top_ids is None
        expected = trajectory_confidence([token_confidence(row) for row in b.top_probs])
        assert b.confidence == o.confidence == expected
        assert b.confidence["window"] == 16 and b.confidence["mean"] > 0
