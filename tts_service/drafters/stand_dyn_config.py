"""`stand-dyn`'s config and rules: what the Python drafter (`stand_dyn`) and the compiled one
(`stand_dyn_compiled`) both read, defined once."""

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
        description="Draft with the compiled kernels (`stand_dyn_compiled`, numba) where they "
        "apply: an in-process store (and, with `drawn`, a noise buffer of at least "
        "(num_nodes + 1) x the store's top-k). The same trees as the Python drafter, a "
        "fraction of the host time; elsewhere the Python drafter runs.",
    )


SUFFIX_ORDERS = (12, 8, 6, 5, 4, 3, 2, 1)
"""The suffix counts' n-gram orders, longest first (a node's lookup takes the longest counted)."""
MIN_SUFFIX = 4  # shorter suffix matches are the store's job
TAIL = max(SUFFIX_ORDERS)  # tokens of context a node keeps
STORE, BACKOFF, SUFFIX, SUCCESSOR, DRAWN = range(5)  # a candidate's source
BINS = 10  # calibration keys per kind: the stored probability's decile


def candidate_kind(source: int, order: int, count: int, agree: int, suffix: int) -> int:
    """One int for (source 0-4, order 0-8, count 0-4, agree 0-1, suffix flag 0-3; for a drawn
    child the suffix flag is its draw's rank, up to 3): what calibration keys on."""
    return (((source * 10 + order) * 5 + count) * 2 + agree) * 4 + suffix


AGREE = candidate_kind(0, 0, 0, 1, 0)  # added to a kind whose token the shorter order agrees on
KIND_COUNT = candidate_kind(DRAWN, 8, 4, 1, 3) + 1  # every kind is below it
