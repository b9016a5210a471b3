"""Drawn against deterministic children, paired (issue 31): the real model scores the trees both
settings of `stand-dyn` draft at the same positions of logged trajectories.

    python bench/drawn_paired.py [--trajectories bench/trajectories-tuning-t1-smollm2.jsonl.gz]
        [--temperature 1.0] [--nodes 8] [--problems 4] [--max-tokens 256]
        [--out runs/drawn-paired.json]
    python bench/drawn_paired.py --setting base='{}' \
        --setting harvest='{"harvest_rejected": true}'     # any two settings of stand-dyn

Live runs at T = 1.0 sample different text each time, so a few percent of acceptance length is
below their run-to-run noise, and replay cannot credit a drawn child (given the logged token, a
tree holding it is likelier than its prior). Here each logged problem's responses run as one
batch through the engine and the real model, twice over in that batch: one row per response
and setting (`drawn: false`, `drawn: true`), each setting with its own store and model state.
Every step every row commits exactly its response's next logged token (teacher forcing), so both
settings draft at the same contexts; the forward gives the target's p at every tree node, and
the measurement is each tree's **expected** committed tokens under that p
(`verify.expected_length`: exact for deterministic children, rule (b), and for drawn ones,
recursive rejection sampling). The drafters observe what the engine would show them: the
verifier's own acceptance of their tree (the row's random stream) and the target's top-k at
its nodes. The mean of those sampled acceptances is printed beside the expectation: the two
agree up to the walk's noise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter
from tqdm import tqdm

from store.memory import InMemoryNgramStore
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.drafters.registry import DrafterConfig, build_drafter, method_drafter
from tts_service.drafters.spec import DraftEnv
from tts_service.engine.acceptance import DenseNodes, Verified, row_probs
from tts_service.engine.batch import BatchDecoder, Row
from tts_service.engine.cost import GPU_LIKE_COST, CostModel
from tts_service.engine.options import DecoderOptions
from tts_service.engine.verify import Acceptance, expected_length, node_support
from tts_service.models import load_model
from tts_service.replay import LoggedProblem, parse_line, sized_fields

LOG = Path(__file__).with_name("trajectories-tuning-t1-smollm2.jsonl.gz")
SETTINGS: dict[str, dict] = {"deterministic": {"drawn": False}, "drawn": {"drawn": True}}
"""The two settings compared by default: `stand-dyn`'s fields each overrides (`--setting`)."""


@dataclass(frozen=True)
class Scored:
    """One response under one setting: per step, the tree's expected committed tokens and what
    the verifier committed of it; and how many drawn nodes its trees held."""

    expected: list[float]
    sampled: list[int]
    drawn_nodes: int


class TeacherForcedDecoder(BatchDecoder):
    """The engine's decoder, but every row commits its logged next token (no draft node kept),
    its drafter observes the verifier's own acceptance of its tree, and each tree's expected
    committed tokens under the target's p is recorded per row."""

    def __init__(self, model) -> None:
        super().__init__(model, eos_ids=[], options=DecoderOptions(cuda_graphs=False))
        self.logged: dict[int, list[int]] = {}  # id(row) -> its response
        self.expected: dict[int, list[float]] = {}  # id(row) -> E[committed] per step
        self.sampled: dict[int, list[int]] = {}  # id(row) -> what the verifier committed
        self.drawn: dict[int, int] = {}  # id(row) -> drawn (sampled) nodes drafted
        self._probs = None
        self._live: list[Verified] = []

    def verify(self, batch, trees, logits, tb, static=None) -> list[Verified]:
        assert static is None, "p at every node is read eagerly (`acceptance.row_probs`)"
        self._live = super().verify(batch, trees, logits, tb)
        self._probs = row_probs(batch, logits)  # the target's p at every node
        out = []
        for b, (row, tree, live) in enumerate(zip(batch, trees, self._live, strict=True)):
            supports = [node_support(tree, i) for i in range(tree.size)]
            nodes = DenseNodes(self._probs[b], supports, [0.5] * tree.size)
            self.expected[id(row)].append(expected_length(tree, nodes))
            self.sampled[id(row)].append(1 + len(live.acc.path))
            self.drawn[id(row)] += sum(tree.sampled)
            token = self.logged[id(row)][len(row.rule.out)]
            out.append(Verified(Acceptance((), (), token), live.top))
        return out

    def _observe(self, batch, trees, verified, plain, observe) -> None:
        super()._observe(batch, trees, self._live, plain, observe)


def read_problems(path: Path, limit: int, max_tokens: int) -> list[LoggedProblem]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [parse_line(line) for line in f if line.strip()][:limit]
    return [
        LoggedProblem(p.prompt_id, p.prompt_ids, [r[:max_tokens] for r in p.responses])
        for p in problems
    ]


def score_problem(
    model,
    problem: LoggedProblem,
    cfgs: dict[str, DrafterConfig],
    per_model: dict[str, dict],
    temperature: float,
    nodes: int,
) -> dict[str, dict[int, Scored]]:
    """One problem's responses under every setting, teacher-forced in one batch: per setting and
    response index, the expected and the sampled committed tokens of every step's tree, and the
    drawn nodes drafted. `per_model` holds each setting's model-scope state across problems."""
    vocab = model.config.vocab_size
    cost = CostModel.fixed(GPU_LIKE_COST)  # as replay sizes trees: the cap decides
    decoder = TeacherForcedDecoder(model)
    rows: list[tuple[str, int, Row]] = []
    for name, cfg in cfgs.items():
        store, per_problem = InMemoryNgramStore(), {}
        for r, resp in enumerate(problem.responses):
            if len(resp) < 2:
                continue
            env = DraftEnv(vocab, store, r, cost, per_model[name], per_problem)
            sampling = SamplingConfig(
                temperature=temperature, max_new_tokens=len(resp), ignore_eos=True, seed=r
            )
            row = decoder.new_row(problem.prompt_ids, build_drafter(cfg, env), sampling)
            decoder.logged[id(row)] = resp
            decoder.expected[id(row)], decoder.sampled[id(row)] = [], []
            decoder.drawn[id(row)] = 0
            rows.append((name, r, row))
    decoder.join([row for _, _, row in rows])
    while decoder.active:
        decoder.step(nodes)
    out: dict[str, dict[int, Scored]] = {name: {} for name in cfgs}
    for name, r, row in rows:
        assert row.rule.out == problem.responses[r], "teacher forcing must hold"
        key = id(row)
        out[name][r] = Scored(decoder.expected[key], decoder.sampled[key], decoder.drawn[key])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=Path, default=LOG)
    ap.add_argument("--temperature", type=float, default=1.0, help="the log's temperature")
    ap.add_argument("--nodes", type=int, default=8, help="the node cap of every tree")
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256, help="per response")
    ap.add_argument("--out", type=Path, default=Path("runs/drawn-paired.json"))
    ap.add_argument(
        "--setting",
        action="append",
        metavar="NAME=JSON",
        help="two of these compare any two settings of stand-dyn's fields (default: drawn)",
    )
    args = ap.parse_args(argv)
    settings = SETTINGS
    if args.setting:
        pairs = [item.split("=", 1) for item in args.setting]
        if len(pairs) != 2 or any(len(p) != 2 for p in pairs):
            ap.error("--setting takes NAME=JSON, exactly twice")
        settings = {name: json.loads(value) for name, value in pairs}
    model = load_model(ModelConfig(name="smollm2-135m")).model
    problems = read_problems(args.trajectories, args.problems, args.max_tokens)
    fields = sized_fields(method_drafter("stand-dyn", {}, "cpu"), args.nodes)
    cfgs = {
        name: TypeAdapter(DrafterConfig).validate_python({**fields, **extra})
        for name, extra in settings.items()
    }
    per_model: dict[str, dict] = {name: {} for name in settings}
    totals = {name: {"steps": 0, "expected": 0.0, "sampled": 0, "drawn": 0} for name in settings}
    by_index: dict[str, dict[int, list[float]]] = {name: {} for name in settings}
    t0, load = time.perf_counter(), os.getloadavg()[0]
    for problem in tqdm(problems, desc="problem", file=sys.stderr):
        scored = score_problem(model, problem, cfgs, per_model, args.temperature, args.nodes)
        for name, per_response in scored.items():
            for r, sc in per_response.items():
                totals[name]["steps"] += len(sc.expected)
                totals[name]["expected"] += sum(sc.expected)
                totals[name]["sampled"] += sum(sc.sampled)
                totals[name]["drawn"] += sc.drawn_nodes
                by_index[name].setdefault(r + 1, []).extend(sc.expected)
    record = {
        "trajectories": args.trajectories.name,
        "temperature": args.temperature,
        "nodes": args.nodes,
        "problems": len(problems),
        "max_tokens": args.max_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "load": round(load, 2),
        "fields": settings,
        "settings": {
            name: {
                "steps": t["steps"],
                "expected_length": round(t["expected"] / t["steps"], 4),
                "sampled_length": round(t["sampled"] / t["steps"], 4),
                "drawn_nodes_per_step": round(t["drawn"] / t["steps"], 3),
                "by_trajectory": {
                    str(i): round(sum(v) / len(v), 4)
                    for i, v in sorted(by_index[name].items())
                    if i in (1, 2, 4, 8, 16)
                },
            }
            for name, t in totals.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    (a, first), (b, second) = ((n, record["settings"][n]) for n in settings)
    print(
        f"{args.trajectories.name}, T = {args.temperature}, {args.nodes} nodes, "
        f"{first['steps']} positions: expected tokens per forward {a} "
        f"{first['expected_length']:.4f} (sampled {first['sampled_length']:.4f}), {b} "
        f"{second['expected_length']:.4f} (sampled {second['sampled_length']:.4f}): "
        f"{second['expected_length'] / first['expected_length']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
