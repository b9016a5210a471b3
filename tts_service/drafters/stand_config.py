"""`stand`'s config: what the Python drafter (`stand`), the compiled one (`stand_compiled`) and
the spine variant (`stand_spine`) read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tts_service.config import Sizing, StrictConfig, TreeName


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
    compiled: bool = Field(
        True,
        description="Draft with the compiled kernel (`stand_compiled`, numba) where it applies: "
        "the same trees, a fraction of the host time.",
    )
