"""What every config shares: strict frozen models, validated text and files, YAML presets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError


def _check_text(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty or blank")
    return text


def _check_file(path: Path | None) -> Path | None:
    if path is not None and not path.is_file():
        raise ValueError(f"no such file: {path}")
    return path


def first_error(err: ValidationError) -> tuple[list[str], str]:
    """The first error's field path (pydantic's, or for a check over several fields the field
    its message names first: `early_stop: ...`) and its message."""
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"]]
    msg = first["msg"].removeprefix("Value error, ")
    named = re.match(r"^([a-z_]+): (.*)$", msg, re.S) if not loc else None
    return ([named.group(1)], named.group(2)) if named else (loc, msg)


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
