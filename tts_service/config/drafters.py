"""Drafter configs, one model per drafter family (`drafters/registry.py` builds them), and the
static tree shapes they name (`configs/trees/<name>.json`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, Field, field_validator

from tts_service.config.base import StrictConfig

TREES_DIR = Path(__file__).resolve().parents[2] / "configs" / "trees"


def resolve_tree_path(name_or_path: str) -> Path:
    """`configs/trees/<name>.json` for a bare name, else the path itself.

    Raises:
        ValueError: no such file (the message lists the known names).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = TREES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in TREES_DIR.glob("*.json"))
        raise ValueError(f"tree {name_or_path!r} not found (known: {', '.join(known)})")
    return path


def _check_tree(name_or_path: str) -> str:
    resolve_tree_path(name_or_path)
    return name_or_path


TreeName = Annotated[str, AfterValidator(_check_tree)]


Sizing = Annotated[
    Literal["fixed", "gt"],
    Field(
        description="fixed: num_nodes every step; gt: the GT rule prunes the tree each step to "
        "what the measured verify cost pays for (num_nodes is the cap)."
    ),
]


class PlainDrafterConfig(StrictConfig):
    """No drafting: every step verifies the root only (plain decoding through the engine)."""

    kind: Literal["plain"] = "plain"


class PldDrafterConfig(StrictConfig):
    """Prompt Lookup Decoding (Saxena 2023): copy the continuation of the latest n-gram match."""

    kind: Literal["pld"] = "pld"
    max_ngram: int = Field(3, ge=1, le=8, description="Longest suffix n-gram tried first.")
    min_ngram: int = Field(1, ge=1, le=8, description="Shortest suffix n-gram tried last.")
    num_draft_tokens: int = Field(6, ge=1, le=64, description="Chain length drafted per step.")


class RecyclingDrafterConfig(StrictConfig):
    """Token Recycling (Luo et al. 2024): top-k successor table refreshed from every forward."""

    kind: Literal["recycling"] = "recycling"
    k: int = Field(8, ge=1, le=10, description="Successors kept per token (table width).")
    tree: TreeName = Field(
        "recycling-80", description="Tree shape: a name in configs/trees or a path."
    )
    num_nodes: int = Field(
        16, ge=1, le=1024, description="Use the first N nodes (BFS) of the tree."
    )
    sizing: Sizing = "fixed"


class StandDrafterConfig(StrictConfig):
    """STAND (Song et al. 2025): stochastic trees drawn from a shared logit n-gram store."""

    kind: Literal["stand"] = "stand"
    tree: TreeName = Field("stand-80", description="A name in configs/trees or a JSON path.")
    num_nodes: int = Field(16, ge=1, le=1024, description="Use the tree's first N nodes.")
    stochastic: bool = Field(True, description="Gumbel-Top-K children; False: top-k (ablation).")
    harvest_rejected: bool = Field(
        False, description="Also store the target's distributions at rejected tree nodes."
    )
    noise_buffer: int = Field(4096, ge=16, description="Gumbel noise values drawn per refill.")
    sizing: Sizing = "fixed"


class StandSpineDrafterConfig(StandDrafterConfig):
    """STAND's branches off a spine copied from an exact match in the problem's trajectories."""

    kind: Literal["stand_spine"] = "stand_spine"  # type: ignore[assignment]
    min_match: int = Field(4, ge=2, le=8, description="Shortest suffix match that lays a spine.")
    max_spine: int = Field(8, ge=1, le=64, description="Longest spine copied.")
    spine_share: float = Field(0.5, gt=0, le=1, description="At most this share of the nodes.")
    consensus_k: int = Field(
        3, ge=1, le=10, description="The spine's first token must be in the store's top k."
    )

    @field_validator("sizing")
    @classmethod
    def _fixed_only(cls, v: str) -> str:
        if v != "fixed":
            raise ValueError("stand_spine trees are sized by num_nodes (use gtcp for GT sizing)")
        return v


class GooseDrafterConfig(StrictConfig):
    """Goose (anisotropic spine trees): a context-match spine with Token Recycling branches."""

    kind: Literal["goose"] = "goose"
    num_nodes: int = Field(59, ge=1, le=1024, description="Draft nodes (the paper's B = 60).")
    max_depth: int = Field(6, ge=1, le=64, description="Branch depth from the branching point.")
    k: int = Field(10, ge=1, le=10, description="Successors kept per token.")
    ngram_orders: tuple[int, ...] = Field((3, 4, 5), description="Context-match n-gram lengths.")
    max_spine: int = Field(20, ge=1, le=256, description="Longest spine continuation.")
    bypass_len: int = Field(8, ge=1, description="A match this long is drafted as a chain.")
    spine_branch_ratio: float = Field(0.5, ge=0, le=1, description="ρ: spine vs root branches.")
    min_score: float = Field(0.01, ge=0, le=1, description="Successors below this are pruned.")
    ema: float = Field(0.3, gt=0, le=1, description="Smoothing of the spine acceptance p̂_s.")
    initial_spine_rate: float = Field(0.3, ge=0, le=1)

    @field_validator("ngram_orders")
    @classmethod
    def _orders(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or min(v) < 1 or max(v) > 16:
            raise ValueError("n-gram lengths must be in 1..16")
        return v


class PtdDrafterConfig(StrictConfig):
    """PTD: the target drafts for itself from a progressive perturbation tree."""

    kind: Literal["ptd"] = "ptd"
    max_depth: int = Field(6, ge=2, le=32, description="The perturbation tree steps past this.")
    max_children: int = Field(4, ge=1, le=16, description="Children per node (width limit).")
    perturbation_nodes: int = Field(16, ge=1, le=512, description="Perturbation tree size cap.")
    candidate_nodes: int = Field(16, ge=1, le=512, description="Candidate nodes verified.")


class GtcpDrafterConfig(StrictConfig):
    """GTCP: dynamic trees over STAND's store, as large as the measured verify cost pays for."""

    kind: Literal["gtcp"] = "gtcp"
    max_nodes: int = Field(128, ge=1, le=1024, description="Hard cap on draft nodes.")
    stochastic: bool = Field(True, description="Gumbel-ordered children; False: top-k.")
    harvest_rejected: bool = False
    noise_buffer: int = Field(4096, ge=16)


class StandDynDrafterConfig(StrictConfig):
    """STAND, dynamic: best-first trees over the store, candidates ranked by an acceptance
    rate learned online; the whole budget, or what the measured verify cost pays for."""

    kind: Literal["stand_dyn"] = "stand_dyn"
    num_nodes: int = Field(80, ge=1, le=1024, description="Draft nodes per step (the cap).")
    sizing: Sizing = "gt"
    harvest_rejected: bool = Field(
        False, description="Also store the target's distributions at rejected nodes."
    )


DrafterConfig = Annotated[
    PlainDrafterConfig
    | PldDrafterConfig
    | RecyclingDrafterConfig
    | StandDrafterConfig
    | StandSpineDrafterConfig
    | GooseDrafterConfig
    | PtdDrafterConfig
    | GtcpDrafterConfig
    | StandDynDrafterConfig,
    Field(discriminator="kind"),
]
DRAFTER_CONFIGS: dict[str, type[BaseModel]] = {
    c.model_fields["kind"].default: c for c in get_args(get_args(DrafterConfig)[0])
}
"""Drafter kind -> its config model (which flags and preset fields a kind takes)."""
