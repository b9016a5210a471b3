"""The field types drafter configs share, torch-free: the static tree shapes they name
(`configs/trees/<name>.json`) and how a tree is sized. Each drafter's config model lives in
its own module (`tts_service/drafters/`), the union of them in `drafters/registry.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

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
