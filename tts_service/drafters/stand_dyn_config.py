"""`stand-dyn`'s config: what the Python drafter (`stand_dyn`) and the compiled one
(`stand_kernel`) read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tts_service.config import Sizing, StrictConfig


class StandDynDrafterConfig(StrictConfig):
    """STAND, dynamic: best-first trees over the store, candidates ranked by an acceptance
    rate learned online; the whole budget, or what the measured verify cost pays for."""

    kind: Literal["stand_dyn"] = "stand_dyn"
    num_nodes: int = Field(80, ge=1, le=1024, description="Draft nodes per step (the cap).")
    sizing: Sizing = "gt"
    harvest_rejected: bool = Field(
        True,
        description="Also store the target's distributions at rejected nodes (another "
        "trajectory of the problem may take the branch a row rejected; paired on the tuning "
        "log, +2.2% tokens per forward at 8 nodes: docs/benchmarks.md, acceptance length).",
    )
    drawn: bool = Field(
        False,
        description="Under sampling, a node may draw its children from the stored distribution "
        "(verified by rejection sampling) where calibration rates that above its best "
        "deterministic candidate; `auto` turns it on on a CPU (registry.AUTO_FIELDS), off "
        "otherwise: deterministic children only.",
    )
    noise_buffer: int = Field(4096, ge=16, description="Gumbel noise values drawn per refill.")
    compiled: bool = Field(
        True,
        description="Draft with the compiled kernel (`stand_kernel`, numba) where it applies: "
        "an in-process store (and, with `drawn`, a noise buffer of at least (num_nodes + 1) x the "
        "store's top-k). The same trees as the Python drafter, a fraction of the host time; "
        "elsewhere the Python drafter runs.",
    )
