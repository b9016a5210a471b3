"""Every drafter family once: its config model, its factory and the shared resources it needs
(`KINDS`). The names users pick are in `drafters/methods.py`; each names a family here.

Adding a family: a config model in `tts_service/config.py` (a member of `DrafterConfig`), its
factory and a `DrafterKind` entry below, and a `Method` in `drafters/methods.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel

from store.base import NgramStore
from tts_service.config import (
    GooseDrafterConfig,
    GtcpDrafterConfig,
    PlainDrafterConfig,
    PldDrafterConfig,
    PtdDrafterConfig,
    RecyclingDrafterConfig,
    StandDrafterConfig,
    StandDynDrafterConfig,
    StandSpineDrafterConfig,
    resolve_tree_path,
)
from tts_service.drafters.base import Drafter, NoDrafter
from tts_service.drafters.goose import AdjacencyTable, GooseDrafter
from tts_service.drafters.gt import GtSizedDrafter, GtTreeDrafter, OnPathStats
from tts_service.drafters.matching import ExactMatchIndex, SuffixCounts
from tts_service.drafters.pld import PromptLookupDrafter
from tts_service.drafters.ptd import PtdDrafter
from tts_service.drafters.recycling import TokenRecyclingDrafter
from tts_service.drafters.stand import StandDrafter
from tts_service.drafters.stand_dyn import (
    SUFFIX_ORDERS,
    AcceptanceCalibration,
    StandDynDrafter,
)
from tts_service.drafters.stand_spine import StandSpineDrafter
from tts_service.engine.cost import VerifyCostSource

SPINE_ORDERS = (8, 6, 5, 4, 3, 2)  # StandSpineDrafterConfig.min_match is 2..8


@dataclass(frozen=True)
class DraftEnv:
    """What a drafter may share beyond its own per-trajectory state.

    `generator` lives as long as the loaded model (Token Recycling's and Goose's successor
    tables: the hot start); `problem` is shared by one problem's trajectories (STAND + spine's
    exact-match index, GT sizing's on-path statistics). Fresh dicts share nothing."""

    vocab_size: int
    store: NgramStore | None = None  # the problem's logit n-gram store
    seed: int = 0  # the trajectory's seed: drafters derive their own stream from it
    cost: VerifyCostSource | None = None  # the verify cost (GT sizing, GTCP)
    generator: dict = field(default_factory=dict)
    problem: dict = field(default_factory=dict)

    def need_store(self, kind: str) -> NgramStore:
        if self.store is None:
            raise ValueError(f"the {kind} drafter needs a logit n-gram store")
        return self.store

    def need_cost(self, kind: str) -> VerifyCostSource:
        if self.cost is None:
            raise ValueError(f"the {kind} drafter needs a measured verify cost (GT sizing)")
        return self.cost


def new_gt_stats(cfg: RecyclingDrafterConfig | StandDrafterConfig) -> OnPathStats:
    """Fresh on-path statistics for a static tree: its calibrated frequency as the prior, or
    0.5^depth for a tree file without one (Token Recycling's template)."""
    data = json.loads(resolve_tree_path(cfg.tree).read_text(encoding="utf-8"))
    freq = data.get("on_path_frequency")
    if isinstance(freq, list):
        return OnPathStats([float(f) for f in freq])
    depth = [0]
    for p in data["parents"][1:]:
        depth.append(depth[p] + 1)
    return OnPathStats([0.5**d for d in depth])


def _gt_sized(
    inner: StandDrafter | TokenRecyclingDrafter,
    cfg: RecyclingDrafterConfig | StandDrafterConfig,
    env: DraftEnv,
) -> Drafter:
    """A static-tree drafter pruned by the GT rule, its on-path statistics per problem."""
    if cfg.sizing == "fixed":
        return inner
    key = ("gt_stats", cfg.model_dump_json())
    if key not in env.problem:
        env.problem[key] = new_gt_stats(cfg)
    return GtSizedDrafter(inner, env.need_cost(cfg.kind), env.problem[key])


def _recycling(cfg: RecyclingDrafterConfig, env: DraftEnv) -> Drafter:
    key = ("recycling", cfg.k)
    if key not in env.generator:  # -1: no successor known yet
        env.generator[key] = torch.full((env.vocab_size, cfg.k), -1, dtype=torch.long)
    return _gt_sized(TokenRecyclingDrafter(cfg, env.vocab_size, env.generator[key]), cfg, env)


def _stand(cfg: StandDrafterConfig, env: DraftEnv) -> Drafter:
    return _gt_sized(StandDrafter(cfg, env.need_store(cfg.kind), env.seed), cfg, env)


def _stand_spine(cfg: StandSpineDrafterConfig, env: DraftEnv) -> Drafter:
    if "spine_index" not in env.problem:
        env.problem["spine_index"] = ExactMatchIndex(SPINE_ORDERS)
    return StandSpineDrafter(cfg, env.need_store(cfg.kind), env.problem["spine_index"], env.seed)


def _goose(cfg: GooseDrafterConfig, env: DraftEnv) -> Drafter:
    key = ("goose", cfg.k)
    if key not in env.generator:
        env.generator[key] = AdjacencyTable(env.vocab_size, cfg.k)
    return GooseDrafter(cfg, env.generator[key])


def _gtcp(cfg: GtcpDrafterConfig, env: DraftEnv) -> Drafter:
    return GtTreeDrafter(cfg, env.need_store(cfg.kind), env.need_cost(cfg.kind), env.seed)


def _stand_dyn(cfg: StandDynDrafterConfig, env: DraftEnv) -> Drafter:
    """Suffix counts per problem; the successor table and the calibration per loaded model
    (what a candidate's acceptance rate is depends on the model, not the problem)."""
    if "suffix_counts" not in env.problem:
        env.problem["suffix_counts"] = SuffixCounts(SUFFIX_ORDERS)
    if "stand_dyn" not in env.generator:
        env.generator["stand_dyn"] = (AdjacencyTable(env.vocab_size, 10), AcceptanceCalibration())
    successors, calibration = env.generator["stand_dyn"]
    cost = env.need_cost(cfg.kind) if cfg.sizing == "gt" else None
    store = env.need_store(cfg.kind)
    return StandDynDrafter(cfg, store, env.problem["suffix_counts"], successors, calibration, cost)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter family: its config model and its factory."""

    config: type[BaseModel]
    build: Callable[[Any, DraftEnv], Drafter]
    uses_store: bool = False  # drafts from the problem's logit n-gram store


KINDS: dict[str, DrafterKind] = {
    k.config.model_fields["kind"].default: k
    for k in (
        DrafterKind(PlainDrafterConfig, lambda cfg, env: NoDrafter()),
        DrafterKind(PldDrafterConfig, lambda cfg, env: PromptLookupDrafter(cfg)),
        DrafterKind(RecyclingDrafterConfig, _recycling),
        DrafterKind(StandDrafterConfig, _stand, uses_store=True),
        DrafterKind(StandSpineDrafterConfig, _stand_spine, uses_store=True),
        DrafterKind(GooseDrafterConfig, _goose),
        DrafterKind(PtdDrafterConfig, lambda cfg, env: PtdDrafter(cfg, env.seed)),
        DrafterKind(GtcpDrafterConfig, _gtcp, uses_store=True),
        DrafterKind(StandDynDrafterConfig, _stand_dyn, uses_store=True),
    )
}


def build_drafter(cfg: BaseModel, env: DraftEnv) -> Drafter:
    """The drafter for `cfg`, sharing what `env` holds.

    Raises:
        ValueError: a resource the drafter needs is missing from `env`.
    """
    return KINDS[cfg.kind].build(cfg, env)  # type: ignore[attr-defined]
