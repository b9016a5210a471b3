"""The names users pick (CLI `--method`, jobs, the HTTP API's `spec_method`, Serve's default):
each a drafter family of `drafters/registry.py` and the fields it sets over the preset. The CLI
choices, the API's allowed values and the tests' parameters all derive from `METHODS`.

Torch-free, so the edges can validate a method before anything heavy is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class Method:
    """A name users pick: a drafter family and the fields the method sets over the preset."""

    kind: str
    help: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    drafts_with_target: bool = False  # needs the model to draft: `tts replay` cannot run it


_GT_CAP = MappingProxyType({"sizing": "gt", "num_nodes": 80})  # the whole 80-node tree is the cap

METHODS: dict[str, Method] = {
    "plain": Method("plain", "plain decoding through the engine (the baseline)"),
    "pld": Method("pld", "Prompt Lookup Decoding: copy after the latest n-gram match"),
    "recycle": Method("recycling", "Token Recycling: successor table over a static tree"),
    "recycle-gt": Method("recycling", "Token Recycling, GT-sized by the measured cost", _GT_CAP),
    "stand": Method("stand", "STAND: stochastic trees from the shared logit n-gram store"),
    "stand-gt": Method("stand", "STAND, GT-sized by the measured verify cost", _GT_CAP),
    "stand+spine": Method("stand_spine", "STAND branches off an exact-match spine"),
    "goose": Method("goose", "Goose: context-match spine with successor branches"),
    "ptd": Method("ptd", "PTD: the target drafts for itself by input perturbation", {}, True),
    "gtcp": Method("gtcp", "GTCP: dynamic best-first trees over the store, GT-sized"),
    "stand-dyn": Method(
        "stand_dyn", "STAND, dynamic: best-first over the store, calibrated acceptance, GT-sized"
    ),
}
REPLAY_METHODS: tuple[str, ...] = tuple(m for m, e in METHODS.items() if not e.drafts_with_target)
"""The methods `tts replay` measures: they draft without the model, deterministically."""
AUTO_METHOD = {"cpu": "stand-dyn", "cuda": "stand-dyn"}
"""What `auto` runs per device type (docs/benchmarks.md, "Every method" and §9): the same
method everywhere; the measured verify cost sizes its trees for the device."""
METHOD_NAMES: tuple[str, ...] = (*METHODS, "auto")
DEFAULT_METHOD = "auto"
"""What runs when no one names a method: the CLI, the jobs, Serve's `default_method`."""
MethodName = Literal[METHOD_NAMES]  # type: ignore[valid-type]


def resolve_method(method: str, device: str) -> str:
    """`auto` -> the method measured best for the device ('auto', 'cpu', 'cuda:0' ...)."""
    if method != "auto":
        return method
    if device == "auto":
        import torch  # only here: the method table stays importable without torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return AUTO_METHOD["cuda" if device.startswith("cuda") else "cpu"]


def method_drafter(method: str, presets: dict[str, dict], device: str = "auto") -> dict:
    """The raw drafter fields of a method: the preset of its kind, then the method's own.

    Raises:
        ValueError: unknown method.
    """
    if method not in METHOD_NAMES:
        raise ValueError(f"unknown method {method!r} (choose {', '.join(METHOD_NAMES)})")
    entry = METHODS[resolve_method(method, device)]
    return {"kind": entry.kind, **presets.get(entry.kind, {}), **entry.fields}
