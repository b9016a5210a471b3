"""`bench/drawn_paired.py`: teacher forcing holds for both settings in one batch, each step's
tree is scored by its exact expected length, and only the drawn setting drafts drawn nodes."""

from __future__ import annotations

import statistics

from pydantic import TypeAdapter

from bench.drawn_paired import SETTINGS, score_problem
from tests.conftest import tiny_llama
from tts_service.drafters.registry import DrafterConfig, method_drafter
from tts_service.replay import LoggedProblem, sized_fields

NODES = 4


def test_both_settings_follow_the_log_and_are_scored_per_step():
    model = tiny_llama(vocab_size=48, seed=1, scale=2.0)
    motif = [5, 9, 13, 17, 21, 25]
    responses = [(motif * 4)[i : i + 18] + [30 + i] for i in range(4)]
    problem = LoggedProblem("p", [1, 2, 3, 4, 5, 9], responses)
    fields = sized_fields(method_drafter("stand-dyn", {}, "cpu"), NODES)
    cfgs = {
        name: TypeAdapter(DrafterConfig).validate_python({**fields, **extra})
        for name, extra in SETTINGS.items()
    }
    per_model: dict[str, dict] = {name: {} for name in SETTINGS}
    scored = score_problem(model, problem, cfgs, per_model, 1.0, NODES)
    assert set(scored) == set(SETTINGS)
    for per_response in scored.values():
        assert sorted(per_response) == [0, 1, 2, 3]
        expected, sampled = [], []
        for r, sc in per_response.items():
            assert len(sc.expected) == len(sc.sampled) == len(responses[r])
            assert all(1.0 <= e <= 1.0 + NODES + 1e-9 for e in sc.expected)
            expected += sc.expected
            sampled += sc.sampled
        # the verifier's own walks average to the exact expectation (up to their noise)
        noise = statistics.pstdev(sampled) / len(sampled) ** 0.5
        assert abs(statistics.fmean(sampled) - statistics.fmean(expected)) <= 5 * noise + 0.02
        assert statistics.fmean(expected) > 1.05  # the motif repeats: trees are accepted
    assert sum(sc.drawn_nodes for sc in scored["deterministic"].values()) == 0
    assert sum(sc.drawn_nodes for sc in scored["drawn"].values()) > 0
