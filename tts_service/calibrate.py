"""Data-driven static trees (STAND): count how often each node of a big tree lies on the
accepted path, keep the best K as a tree.

With in-order verification, whether a node is accepted depends only on its ancestors and
earlier siblings, so any subtree closed under parents and earlier siblings has expected
acceptance length 1 + the sum of its nodes' on-path frequencies. Best-first
selection over that closure keeps the most useful K nodes, and its order makes every prefix
of the result the best tree of that size. See docs/design.md, "STAND drafting".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tts_service.drafters.base import StaticTreeDrafter, shape_prefix
from tts_service.drafters.stand_config import StandDrafterConfig
from tts_service.engine.seam import Deferred, DraftContext, Drafter, NodeTopK
from tts_service.engine.tree import DraftTree, TreeShape, select_subtree
from tts_service.engine.verify import Acceptance

BIG_TREE_NODES = 1024  # the calibration tree's cap: the whole 625-node shape is drafted


class OnPathCounter(Drafter):
    """Wraps a STAND drafter and counts, per shape node, how often it was accepted."""

    def __init__(self, inner: StaticTreeDrafter) -> None:
        self.inner = inner
        self.counts = [0] * len(inner.shape.parents)
        self.steps = 0
        self._shape_ids: tuple[int, ...] = (0,)  # the last tree's: tree node -> shape node

    def start(self, prompt_ids: list[int]) -> None:
        self.inner.start(prompt_ids)

    def draft(self, ctx: DraftContext) -> DraftTree:
        shaped = self.inner.draft_subtree(ctx, shape_prefix(self.inner, ctx))
        self._shape_ids = shaped.shape_ids
        return shaped.tree

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> Deferred | None:
        self.steps += 1
        for node in acc.path:
            self.counts[self._shape_ids[node]] += 1
        return self.inner.observe(tree, acc, topk)

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> Deferred | None:
        return self.inner.observe_root(tokens, topk)


@dataclass(frozen=True)
class CalibratedTree:
    parents: list[int]
    frequencies: list[float]  # per node: accepted-on-path count / verify steps

    @property
    def expected_acceptance_length(self) -> float:
        return 1.0 + sum(self.frequencies[1:])


def build_tree(shape: TreeShape, counts: list[int], steps: int, k: int) -> CalibratedTree:
    chosen = select_subtree(shape, counts, k)
    new_id = {old: new for new, old in enumerate(chosen)}
    parents = [-1] + [new_id[shape.parents[old]] for old in chosen[1:]]
    freqs = [1.0] + [counts[old] / max(steps, 1) for old in chosen[1:]]
    return CalibratedTree(parents, freqs)


def write_tree(path: Path, name: str, tree: CalibratedTree, provenance: dict) -> None:
    depth = [0] * len(tree.parents)
    for i, p in enumerate(tree.parents[1:], start=1):
        depth[i] = depth[p] + 1
    data = {
        "name": name,
        "source": provenance,
        "num_nodes": len(tree.parents) - 1,
        "max_depth": max(depth),
        "expected_acceptance_length": round(tree.expected_acceptance_length, 4),
        "parents": tree.parents,
        "on_path_frequency": [round(f, 5) for f in tree.frequencies],
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _provenance(req, **facts) -> dict:
    return {
        "made_by": "tts calibrate-tree",
        "procedure": "STAND App. A.1: run a big tree over a calibration set, count how often "
        "each node lies on the accepted path, keep the best nodes (closed under parents and "
        "earlier siblings, best first, so every prefix is the best tree of its size)",
        "init_tree": req.init_tree,
        **facts,
    }


def _finish(req, counters: list[OnPathCounter], facts: dict) -> CalibratedTree:
    shape = counters[0].inner.shape
    counts = [sum(c.counts[i] for c in counters) for i in range(len(shape.parents))]
    steps = sum(c.steps for c in counters)
    tree = build_tree(shape, counts, steps, req.nodes)
    write_tree(req.out, req.out.stem, tree, _provenance(req, verify_steps=steps, **facts))
    return tree


def calibrate(generator, req) -> CalibratedTree:
    """Live: `req.n` trajectories per calibration prompt with the big tree, a fresh store per
    prompt, one after another through the runner (each drafts from what the earlier ones of
    its prompt stored); write the best `req.nodes` nodes to `req.out`."""
    from dataclasses import replace

    from tqdm import tqdm

    from store.memory import InMemoryNgramStore
    from tts_service.runner import TrajectoryRunner
    from tts_service.trajectory import trajectory_requests

    prompts = [json.loads(x)["prompt"] for x in req.prompts.read_text().splitlines() if x.strip()]
    cfg = StandDrafterConfig(tree=req.init_tree, num_nodes=BIG_TREE_NODES)
    counters: list[OnPathCounter] = []
    requests = []
    for p_idx, prompt in enumerate(prompts):
        ids = generator.encode(prompt, chat=req.chat)
        store = InMemoryNgramStore()
        for r in trajectory_requests(str(p_idx), ids, range(req.n), req.sampling, cfg, store):
            requests.append(replace(r, wrap=lambda d: _counted(d, counters)))
    runner = TrajectoryRunner(generator, 1, "fixed", token_budget=BIG_TREE_NODES + 1)
    with tqdm(total=len(requests), desc="calibration trajectories") as bar:
        report = runner.run(requests, on_result=lambda _res: bar.update(1))
    facts = {
        "mode": "live",
        "model": req.model.name,
        "prompts": str(req.prompts),
        "num_prompts": len(prompts),
        "trajectories_per_prompt": req.n,
        "temperature": req.sampling.temperature,
        "max_new_tokens": req.sampling.max_new_tokens,
        "generated_tokens": sum(r.output.stats.new_tokens for r in report.results),
    }
    return _finish(req, counters, facts)


def _counted(drafter, counters: list[OnPathCounter]) -> OnPathCounter:
    counter = OnPathCounter(drafter)
    counters.append(counter)
    return counter


def calibrate_from_log(req, problems) -> CalibratedTree:
    """Replay: the same counts from logged trajectories (deterministic drafting), no model."""
    from tts_service.replay import replay

    cfg = StandDrafterConfig(tree=req.init_tree, num_nodes=BIG_TREE_NODES)
    counters: list[OnPathCounter] = []
    report = replay(problems, cfg, BIG_TREE_NODES, wrap=lambda d: _counted(d, counters))
    facts = {
        "mode": "replay",
        "trajectories": str(req.trajectories),
        "num_prompts": len(problems),
        "generated_tokens": report.tokens,
    }
    return _finish(req, counters, facts)
