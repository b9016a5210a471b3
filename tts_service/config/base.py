"""What every config shares: strict frozen models, validated text and files, YAML presets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict


def _check_text(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty or blank")
    return text


def _check_file(path: Path | None) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"no such file: {path}")
    return path


Text = Annotated[str, AfterValidator(_check_text)]
ExistingFile = Annotated[Path, AfterValidator(_check_file)]


class StrictConfig(BaseModel):
    """Unknown fields are errors (a typo never silently falls back to a default); frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def load_yaml(path: str | Path) -> dict:
    """Read a preset from `configs/`; the caller validates it into a model."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
