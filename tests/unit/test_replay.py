"""Trajectory logs and offline replay."""

from __future__ import annotations

import gzip
import json
import random

import pytest
import torch

from tests.conftest import COPYING_KINDS, make_drafter, tiny_llama
from tests.engine_loop import generate
from tts_service.config import SamplingConfig
from tts_service.drafters.pld import PldDrafterConfig
from tts_service.drafters.registry import METHODS, REPLAY_METHODS
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import Drafter
from tts_service.replay import LoggedProblem, parse_line, read_log, replay, replay_config
from tts_service.runner import TrajectoryRecorder
from tts_service.schemas import ReplayRequest


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
    report = replay(problems, cfg, vocab_size=128)  # each problem's trajectories share a store
    assert report.tokens == sum(t for t, _ in live)
    assert report.steps == sum(f for _, f in live)  # exactly, step for step
    assert report.tokens / report.steps > 1.2


def test_pld_replay_on_a_hand_made_repeat():
    # step 1: no earlier n-gram for the suffix -> commit "5" alone
    # step 2: suffix [5] matched at 0 -> draft 6 7 8 5; the response ends after 6 7 8
    problem = LoggedProblem("h", [5, 6, 7, 8], [[5, 6, 7, 8]])
    report = replay([problem], PldDrafterConfig(), vocab_size=16)
    assert (report.tokens, report.steps) == (4, 2)
    assert report.accepted_at_depth == [1, 1, 1]


def test_stand_replay_on_a_hand_made_repeat():
    one_hot = [[[3], [4], [5]], [[1.0], [1.0], [1.0]]]
    problem = LoggedProblem("h", [1, 2], [[3, 4, 5], [3, 4, 5]], [one_hot[0]] * 2, [one_hot[1]] * 2)
    cfg = StandDrafterConfig(tree="stand-625", num_nodes=8)
    report = replay([problem], cfg, vocab_size=8)  # one problem's trajectories share a store
    # response 0: empty store, 3 steps of 1 token; response 1: the chain 3 4 5 in one step
    assert report.to_dict()["acceptance_length_by_index"] == [1.0, 3.0]
    assert (report.tokens, report.steps) == (6, 4)


def test_merged_reports_of_separate_replays_equal_one_replay_of_their_problems():
    """Each problem has its own store, so replaying them apart and pooling is the same replay."""
    one_hot = [[[3], [4], [5]], [[1.0], [1.0], [1.0]]]
    a = LoggedProblem("a", [1, 2], [[3, 4, 5], [3, 4, 5]], [one_hot[0]] * 2, [one_hot[1]] * 2)
    b = LoggedProblem("b", [5, 6, 7, 8], [[5, 6, 7, 8, 5, 6, 7]])
    cfg = StandDrafterConfig(tree="stand-625", num_nodes=8)
    whole, pooled = replay([a, b], cfg, vocab_size=16), replay([a], cfg, vocab_size=16)
    pooled.merge(replay([b], cfg, vocab_size=16))
    for report in (whole, pooled):
        report.seconds = 0.0
    assert pooled == whole and pooled.steps < pooled.tokens  # something was accepted


def test_a_drafter_that_fails_in_replay_fails_the_replay_with_its_own_error():
    """The runner's failure path resets replay's decoder as it resets the engine's: the
    drafter's error reaches the caller, not one from the reset."""

    class Broken(Drafter):
        def __init__(self, drafter) -> None:
            self.drafter = drafter

        def start(self, prompt_ids: list[int]) -> None:
            raise RuntimeError("drafter broke")

    problem = LoggedProblem("h", [5, 6, 7, 8], [[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match="drafter broke"):
        replay([problem], PldDrafterConfig(), vocab_size=16, wrap=Broken)


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


def _synthetic_log(path, problems: int = 2, responses: int = 4, length: int = 40) -> None:
    """Repetitive responses over a small vocabulary, each token with a top-3 row around it."""
    rng = random.Random(0)
    lines = []
    for p in range(problems):
        phrase = [rng.randrange(1, 30) for _ in range(8)]
        resps = [[rng.choice([*phrase, rng.randrange(1, 30)]) for _ in range(length)]]
        resps += [phrase * (length // 8) for _ in range(responses - 1)]
        ids = [[[t, (t + 1) % 32, (t + 2) % 32] for t in r] for r in resps]
        probs = [[[0.6, 0.3, 0.1] for _ in r] for r in resps]
        lines.append(LoggedProblem(f"p{p}", phrase[:4], resps, ids, probs).to_json())
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


class _Recording(Drafter):
    """A drafter that keeps every tree's draft node count (and drafts alone: a compiled
    drafter's group would draft around `draft`)."""

    def __init__(self, inner, sizes: list) -> None:
        self.inner, self.sizes = inner, sizes

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def draft(self, ctx):
        tree = self.inner.draft(ctx)
        self.sizes.append(tree.size - 1)
        return tree

    def observe(self, tree, acc, topk):
        return self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens, topk):
        return self.inner.observe_root(tokens, topk)


def _run(path, method: str, nodes: int | None = None, sizes: list | None = None) -> dict:
    req = ReplayRequest(method=method, trajectories=path, nodes=nodes, vocab_size=32)
    problems, errors = read_log(req.trajectories, req.vocab_size, strict=True)

    def recorded(drafter):
        return drafter if sizes is None else _Recording(drafter, sizes)

    report = replay(problems, replay_config(req), nodes or 1024, req.vocab_size, recorded)
    report = report.to_dict()
    return {k: v for k, v in report.items() if k != "seconds"}


def test_replay_covers_the_model_free_methods():
    assert "ptd" not in REPLAY_METHODS
    assert {"gtcp", "stand+spine", "goose", "recycle-gt", "stand-gt"} <= set(REPLAY_METHODS)


@pytest.mark.parametrize("method", REPLAY_METHODS)
def test_every_method_replays_a_gzipped_log_deterministically(tmp_path, method):
    path = tmp_path / "log.jsonl.gz"
    _synthetic_log(path)
    first, second = _run(path, method), _run(path, method)
    assert first == second
    assert first["tokens"] == 2 * 4 * 40  # every logged token, committed exactly once
    if method != "plain":  # the repeated phrase is drafted (a new family: something accepted)
        assert first["acceptance_length"] > (1.2 if METHODS[method].kind in COPYING_KINDS else 1)


@pytest.mark.parametrize("method", [m for m in REPLAY_METHODS if m != "plain"])
def test_nodes_caps_every_step_of_every_method(tmp_path, method):
    path = tmp_path / "log.jsonl.gz"
    _synthetic_log(path)
    sizes: list[int] = []
    _run(path, method, nodes=3, sizes=sizes)
    assert sizes and max(sizes) <= 3
    if method in {"gtcp", "recycle-gt", "stand-gt", "stand-dyn"}:  # GT-sized: the cap is what binds
        assert max(sizes) == 3


def test_per_trajectory_index_breakdown_on_a_hand_made_log(tmp_path):
    # 16 identical responses [3, 4, 5] with one-hot targets: the first meets an empty store (3
    # steps of 1 token), every later one drafts the chain from it (1 step of 3 tokens)
    rows = [[[3], [4], [5]], [[1.0], [1.0], [1.0]]]
    problem = LoggedProblem("h", [1, 2], [[3, 4, 5]] * 16, [rows[0]] * 16, [rows[1]] * 16)
    short = LoggedProblem("s", [1, 2], [[6, 7]] * 3, [[[6], [7]]] * 3, [[[1.0], [1.0]]] * 3)
    path = tmp_path / "log.jsonl"
    _write(path, [problem, short])
    report = _run(path, "stand", nodes=8)
    # index 1: (3 + 2 tokens) / (3 + 2 steps); 2: (3 + 2) / (1 + 1); 4..16: problem "h" alone
    assert report["acceptance_length_at_trajectory"] == {
        "1": 1.0,
        "2": 2.5,
        "4": 3.0,
        "8": 3.0,
        "16": 3.0,
    }
    assert len(report["acceptance_length_by_index"]) == 16
