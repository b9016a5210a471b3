"""The one list of drafter families (`SPECS`) and everything derived from it: the config union
the edges validate (`DrafterConfig`), the names users pick (`METHODS`: CLI `--method`, jobs, the
HTTP API's `spec_method`, Serve's default, the tests' parameters), the factory
(`build_drafter`) and the size knob of each kind (`size_field`).

Adding a method: one drafter module declaring a `SPEC` (`drafters/spec.py`; docs/design.md,
"Adding a method") and its line in `DRAFTER_MODULES` below. A module outside this repository
is named in `TTS_DRAFTERS` instead (comma-separated importable module paths, each with a
`SPEC`), read once when this module is imported (it says which code is loaded, so every
process, Ray's workers included, must see the same value); a drafter module must not import
this one.
"""

from __future__ import annotations

import importlib
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, Field

from tts_service.drafters.awaiting_claim import AwaitingClaim
from tts_service.drafters.spec import DraftEnv, DrafterSpec, Method, Shared
from tts_service.engine.sampling import SamplingParams
from tts_service.engine.seam import Drafter
from tts_service.engine.streams import drafter_seed, verify_key

if TYPE_CHECKING:
    from store.base import NgramStore
    from tts_service.engine.cost import VerifyCostSource

__all__ = [
    "AUTO_FIELDS",
    "AUTO_METHOD",
    "DEFAULT_METHOD",
    "DRAFTER_CONFIGS",
    "DraftEnv",
    "DrafterConfig",
    "DrafterSpec",
    "KINDS",
    "METHODS",
    "METHOD_NAMES",
    "Method",
    "MethodName",
    "REPLAY_METHODS",
    "DRAFTER_MODULES",
    "SPECS",
    "build_drafter",
    "method_drafter",
    "method_name",
    "resolve_method",
    "size_field",
]

DRAFTER_MODULES: tuple[str, ...] = (
    "tts_service.drafters.base",  # plain
    "tts_service.drafters.pld",
    "tts_service.drafters.recycling",
    "tts_service.drafters.stand",
    "tts_service.drafters.stand_spine",
    "tts_service.drafters.goose",
    "tts_service.drafters.ptd",
    "tts_service.drafters.gtcp",
    "tts_service.drafters.stand_dyn",
)
"""The in-tree drafter modules, in the order the edges list their methods."""


def load_specs(modules: str | Sequence[str]) -> tuple[DrafterSpec, ...]:
    """The `SPEC` of each module named in `modules` (import paths, or one string of them
    separated by commas, as `TTS_DRAFTERS` holds them).

    Raises:
        ImportError: a module is missing or has no `SPEC`.
    """
    names = modules.split(",") if isinstance(modules, str) else modules
    specs = []
    for name in (n.strip() for n in names):
        if not name:
            continue
        spec = getattr(importlib.import_module(name), "SPEC", None)
        if not isinstance(spec, DrafterSpec):
            raise ImportError(f"{name} has no SPEC (a tts_service.drafters.spec.DrafterSpec)")
        specs.append(spec)
    return tuple(specs)


SPECS: tuple[DrafterSpec, ...] = load_specs(DRAFTER_MODULES)
"""The in-tree drafter families' specs."""


def _index(specs: tuple[DrafterSpec, ...]) -> dict[str, DrafterSpec]:
    """kind -> spec, refusing two families with one kind, one method name or one shared-state
    name."""
    kinds: dict[str, DrafterSpec] = {}
    methods: set[str] = {"auto"}
    shared: dict[str, Shared] = {}
    for spec in specs:
        if spec.kind in kinds:
            raise ValueError(f"drafter kind {spec.kind!r} is registered twice")
        kinds[spec.kind] = spec
        for m in spec.methods:
            if m.name in methods:
                raise ValueError(f"method {m.name!r} is registered twice")
            methods.add(m.name)
        for s in spec.shared:
            if shared.setdefault(s.name, s) is not s:
                raise ValueError(f"shared state {s.name!r} is declared by two drafters")
    return kinds


KINDS: dict[str, DrafterSpec] = _index(SPECS + load_specs(os.environ.get("TTS_DRAFTERS", "")))
"""Drafter kind -> its spec: the in-tree families, then those named in `TTS_DRAFTERS`."""

DRAFTER_CONFIGS: dict[str, type[BaseModel]] = {k: s.config for k, s in KINDS.items()}
"""Drafter kind -> its config model (which flags and preset fields a kind takes)."""

DrafterConfig = Annotated[
    Union[tuple(DRAFTER_CONFIGS.values())],  # type: ignore[valid-type]  # noqa: UP007
    Field(discriminator="kind"),
]
"""Any drafter's config, told apart by `kind` (what requests, jobs and presets carry)."""

METHODS: dict[str, Method] = {m.name: m for s in KINDS.values() for m in s.methods}
"""Method name -> its drafter kind and the fields it sets over the kind's preset."""
REPLAY_METHODS: tuple[str, ...] = tuple(m for m, e in METHODS.items() if not e.drafts_with_target)
"""The methods `tts replay` measures: they draft without the model, deterministically."""
AUTO_METHOD = {"cpu": "stand-dyn", "cuda": "stand-dyn"}
"""What `auto` runs per device type (docs/benchmarks.md, "Which method `auto` runs"): the same
method everywhere; the measured verify cost sizes its trees for the device."""
AUTO_FIELDS: dict[str, dict[str, Any]] = {"cpu": {"drawn": True, "compiled": False}, "cuda": {}}
"""`auto`'s drafter fields per device type, beneath the user's preset (docs/benchmarks.md,
"Acceptance length in replay and live"): on a CPU, children drawn from the stored
distribution under sampling (more tokens per forward at T = 1.0, the same speed at T = 0.6,
nothing under greedy), drafted in Python (the kernels' load would cost a CPU run more than they
save beside 30-100 ms forwards, and a CPU model load imports no numba); on a GPU not yet: drawn
rows cost the host more than deterministic ones (+0.10–0.15 ms a step at 16 rows on this CPU's
host: "The host path"), which by arithmetic they now repay at both temperatures, but no GPU
run has measured it yet."""
DEVICE_FIELDS: dict[str, dict[str, dict[str, Any]]] = {"stand": {"cpu": {"compiled": False}}}
"""A drafter kind's fields per device type, beneath the user's preset: on a CPU `stand` drafts
in Python, where its compiled drafter saves ~1% of a step (a forward costs 30-100 ms) and its
kernels' load cost `tts solve --method stand` 0.7 s (docs/benchmarks.md, "Start-up")."""
METHOD_NAMES: tuple[str, ...] = (*METHODS, "auto")
DEFAULT_METHOD = "auto"
"""What runs when no one names a method: the CLI, the jobs, Serve's `default_method`."""
MethodName = Literal[METHOD_NAMES]  # type: ignore[valid-type]


def method_name(drafter: BaseModel) -> str:
    """The method a drafter config runs, as users name it (`stand-dyn`, not its kind
    `stand_dyn`): the kind's method whose fields the config has, else the kind's first."""
    kind = drafter.kind  # type: ignore[attr-defined]
    named = [m for m in METHODS.values() if m.kind == kind]
    for m in sorted(named, key=lambda m: -len(m.fields)):  # the most specific first
        if all(getattr(drafter, k, None) == v for k, v in m.fields.items()):
            return m.name
    return named[0].name if named else kind


def resolve_method(method: str, device: str) -> str:
    """`auto` -> the method measured best for the device ('auto', 'cpu', 'cuda:0' ...)."""
    return method if method != "auto" else AUTO_METHOD[device_type(device)]


def device_type(device: str) -> str:
    """'cpu' or 'cuda' for a device name ('auto': cuda if present)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def method_drafter(method: str, presets: dict[str, dict], device: str = "auto") -> dict:
    """The raw drafter fields of a method: its kind's for the device (`DEVICE_FIELDS`) and
    `auto`'s (`AUTO_FIELDS`), the preset of its kind over them, then the method's own.

    Raises:
        ValueError: unknown method.
    """
    if method not in METHOD_NAMES:
        raise ValueError(f"unknown method {method!r} (choose {', '.join(METHOD_NAMES)})")
    entry = METHODS[resolve_method(method, device)]
    kind, where = entry.kind, device_type(device)
    chosen = {**DEVICE_FIELDS.get(kind, {}).get(where, {})}
    if method == "auto":
        chosen |= AUTO_FIELDS[where]
    return {"kind": kind, **chosen, **presets.get(kind, {}), **entry.fields}


def size_field(kind: str) -> str | None:
    """The field `--num-nodes` (replay's `--nodes`) sets for `kind`; None: it has none."""
    return KINDS[kind].size_field


def build_drafter(cfg: Any, env: DraftEnv) -> Drafter:
    """The drafter for `cfg`, sharing what `env` holds.

    Raises:
        ValueError: a resource the drafter needs is missing from `env`.
    """
    return KINDS[cfg.kind].build(cfg, env)


class VerifyKeyReusedError(ValueError):
    """A row's verify stream already taught state its drafter would read: its drafts would
    depend on the uniforms that verify them (docs/design.md, "Random streams")."""


class RowDrafters:
    """One drafter per trajectory (its own per-sequence state: PLD's index, the last tree),
    over what one loaded model's drafters share (successor tables, the hot start, calibration)
    and what one problem's share (the spine index, GT's on-path statistics: one per store,
    gone with it). The live model (`generation.Generator`) and replay (`replay.LoggedTarget`)
    each hold one.

    It is also the ledger that keeps drafts independent of their verification: every drafting
    row's verify key is claimed here (the model's state, and whatever else the model holds:
    the allocator's slot statistics) and in the row's store (its problem, its global tier,
    across runs when the store persists); a key either has seen is refused."""

    def __init__(self, vocab_size: int, cost: VerifyCostSource | None) -> None:
        self.vocab_size, self.cost = vocab_size, cost
        self.per_model: dict = {}
        self.per_store: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.verify_keys: set[int] = set()  # of every drafting row built over this model

    def build(self, cfg: Any, store: NgramStore, params: SamplingParams) -> Drafter:
        """The drafter of one trajectory of `store`'s problem, seeded by the trajectory.

        Raises:
            VerifyKeyReusedError: a drafting row's verify key (seed and salt) was claimed
                before, here or in the store.
        """
        key = verify_key(params.seed, params.salt)  # a row that drafts and samples
        if key is not None:
            self._claim(key, store, params)
        problem = self.per_store.setdefault(store, {})
        seed = drafter_seed(params.seed, params.salt)
        env = DraftEnv(self.vocab_size, store, seed, self.cost, self.per_model, problem)
        drafter = build_drafter(cfg, env)
        if key is not None and store.confirmed(key) is not True:  # a shared store: not yet
            return AwaitingClaim(drafter, store, key)
        return drafter

    def _claim(self, key: int, store: NgramStore, params: SamplingParams) -> None:
        where = "this model's drafters" if key in self.verify_keys else None
        if where is None and not store.claim(key):
            where = "the problem's store"
        if where is not None:
            raise VerifyKeyReusedError(
                f"a row verified with the same uniforms (seed {params.seed}, salt "
                f"{params.salt or 'none'}) already taught {where}: a draft from it would depend "
                "on the numbers that verify it. Leave sampling.run_nonce unset (every run draws "
                "its own), or reproduce a run against a fresh store and a fresh process"
            )
        self.verify_keys.add(key)
