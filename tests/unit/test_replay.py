"""Trajectory logs and offline replay."""

from __future__ import annotations

import json

import pytest
import torch

from store.memory import InMemoryNgramStore
from tests.conftest import make_drafter, tiny_llama
from tts_service.config import PldDrafterConfig, SamplingConfig, StandDrafterConfig
from tts_service.drafters.registry import DraftEnv, build_drafter
from tts_service.engine.batch import generate
from tts_service.replay import LoggedProblem, TrajectoryRecorder, parse_line, read_log, replay


def _write(path, problems) -> None:
    path.write_text("".join(p.to_json() + "\n" for p in problems))


@pytest.mark.parametrize(
    "cfg",
    [PldDrafterConfig(num_draft_tokens=5), StandDrafterConfig(tree="stand-625", num_nodes=40)],
    ids=["pld", "stand"],
)
def test_replay_of_a_logged_greedy_run_equals_the_live_acceptance(cfg):
    model = tiny_llama(vocab_size=128, seed=2, scale=6.0)
    greedy = SamplingConfig(temperature=0, max_new_tokens=48)
    problems, live = [], []
    for p in range(2):
        prompt = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(p)).tolist()
        recorder = TrajectoryRecorder(make_drafter(cfg, 128))
        responses, ids, probs = [], [], []
        for _ in range(3):  # trajectories share the drafter (and STAND's store)
            res = generate(model, prompt, recorder, greedy, eos_ids=[])
            rows = recorder.rows(len(res.token_ids))
            responses.append(list(res.token_ids))
            ids.append(rows[0])
            probs.append(rows[1])
            live.append((res.stats.new_tokens, res.stats.target_forwards))
        problems.append(LoggedProblem(f"p{p}", prompt, responses, ids, probs))
    problems = [parse_line(p.to_json()) for p in problems]  # through the JSON format
    report = replay(problems, lambda i: make_drafter(cfg, 128))
    assert report.tokens == sum(t for t, _ in live)
    assert report.steps == sum(f for _, f in live)  # exactly, step for step
    assert report.tokens / report.steps > 1.2


def test_pld_replay_on_a_hand_made_repeat():
    # step 1: no earlier n-gram for the suffix -> commit "5" alone
    # step 2: suffix [5] matched at 0 -> draft 6 7 8 5; the response ends after 6 7 8
    problem = LoggedProblem("h", [5, 6, 7, 8], [[5, 6, 7, 8]])
    shared = build_drafter(PldDrafterConfig(), DraftEnv(16))
    report = replay([problem], lambda _: shared)
    assert (report.tokens, report.steps) == (4, 2)
    assert report.accepted_at_depth == [1, 1, 1]


def test_stand_replay_on_a_hand_made_repeat():
    one_hot = [[[3], [4], [5]], [[1.0], [1.0], [1.0]]]
    problem = LoggedProblem("h", [1, 2], [[3, 4, 5], [3, 4, 5]], [one_hot[0]] * 2, [one_hot[1]] * 2)
    cfg = StandDrafterConfig(tree="stand-625", num_nodes=8)
    report = replay([problem], lambda _: build_drafter(cfg, DraftEnv(8, InMemoryNgramStore())))
    # response 0: empty store, 3 steps of 1 token; response 1: the chain 3 4 5 in one step
    assert report.to_dict()["acceptance_length_by_index"] == [1.0, 3.0]
    assert (report.tokens, report.steps) == (6, 4)


def test_malformed_lines_are_reported_with_their_line_number(tmp_path):
    good = LoggedProblem("ok", [1, 2], [[3, 4]], [[[3], [4]]], [[[1.0], [1.0]]])
    lines = [
        good.to_json(),
        json.dumps({"prompt_id": "a", "responses": [[1]]}),  # 2: no prompt_ids
        json.dumps({**json.loads(good.to_json()), "top_ids": [[[3]]]}),  # 3: ragged rows
        json.dumps({**json.loads(good.to_json()), "responses": [[3, 999]]}),  # 4: id >= vocab
        "{not json",  # 5
        json.dumps({**json.loads(good.to_json()), "top_probs": [[[1.0, 0.0], [1.0]]]}),  # 6
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems, errors = read_log(path, vocab_size=100)
    assert len(problems) == 1
    assert [e.split(":")[1] for e in errors] == ["2", "3", "4", "5", "6"]
    assert "prompt_ids" in errors[0] and "999" in errors[2] and "ragged" in errors[4]
