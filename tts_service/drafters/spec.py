"""What a drafter module declares (`SPEC`) and what a drafter may share (`DraftEnv`).

A drafter module is one file: its config model (a pydantic model with a `kind` literal), its
drafter, and a module-level `SPEC = DrafterSpec(...)` naming the model, the factory, the
state it shares beyond one trajectory (`Shared`), the field `--num-nodes` sets, and the
methods (the names users pick) it offers. `drafters/registry.py` lists the SPECs and derives
everything else from them: the config union, the method table, the factory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from pydantic import BaseModel

if TYPE_CHECKING:
    from store.base import NgramStore
    from tts_service.engine.cost import VerifyCostSource
    from tts_service.engine.seam import Drafter

C = TypeVar("C", bound=BaseModel)
T = TypeVar("T")


def _one_per_scope(cfg: Any) -> Hashable:
    return None


@dataclass(frozen=True, eq=False)
class Shared(Generic[C, T]):
    """State shared beyond one trajectory, made on first use.

    `scope="model"` lives as long as the loaded model (Token Recycling's and Goose's successor
    tables: the hot start); `scope="problem"` is shared by one problem's trajectories (STAND +
    spine's exact-match index, GT sizing's on-path statistics). Configs with the same `key`
    share one instance; `name` must be unique in the registry."""

    name: str
    scope: Literal["model", "problem"]
    make: Callable[[C, int], T]  # (the drafter's config, the vocabulary size) -> fresh state
    key: Callable[[C], Hashable] = _one_per_scope


@dataclass(frozen=True)
class DraftEnv:
    """What a drafter may share beyond its own per-trajectory state.

    `per_model` and `per_problem` hold the `Shared` state of the loaded model and of one
    problem; their owner decides how long each lives (fresh dicts share nothing). Drafters read
    them through `shared`, never by key."""

    vocab_size: int
    store: NgramStore | None = None  # the problem's logit n-gram store
    seed: int = 0  # the trajectory's seed: drafters derive their own stream from it
    cost: VerifyCostSource | None = None  # the verify cost (GT sizing, GTCP)
    per_model: dict = field(default_factory=dict)
    per_problem: dict = field(default_factory=dict)

    def shared(self, state: Shared[C, T], cfg: C) -> T:
        """`state` for `cfg` in its scope, made on first use."""
        holder = self.per_model if state.scope == "model" else self.per_problem
        key = (state.name, state.key(cfg))
        if key not in holder:
            holder[key] = state.make(cfg, self.vocab_size)
        return holder[key]

    def need_store(self, kind: str) -> NgramStore:
        if self.store is None:
            raise ValueError(f"the {kind} drafter needs a logit n-gram store")
        return self.store

    def need_cost(self, kind: str) -> VerifyCostSource:
        if self.cost is None:
            raise ValueError(f"the {kind} drafter needs a measured verify cost (GT sizing)")
        return self.cost


@dataclass(frozen=True)
class Method:
    """A name users pick (CLI `--method`, jobs, the HTTP API's `spec_method`, Serve's default):
    the fields it sets over its kind's preset. `kind` is filled in by the `DrafterSpec`."""

    name: str
    help: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    drafts_with_target: bool = False  # needs the model to draft: `tts replay` cannot run it
    kind: str = ""


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter family, as its module declares it (`SPEC`)."""

    config: type[BaseModel]  # a pydantic model with `kind: Literal["..."] = "..."`
    build: Callable[[Any, DraftEnv], Drafter]  # (config, env) -> a drafter for one trajectory
    methods: tuple[Method, ...] = ()
    size_field: str | None = None  # what `--num-nodes` (replay's `--nodes`) sets; None: none
    needs_cost: bool = False  # may price nodes with the measured verify cost (GT sizing)
    uses_store: bool = False  # drafts from the problem's logit n-gram store
    shared: tuple[Shared, ...] = ()  # the state it reads through `DraftEnv.shared`
    kernels: Callable[[Any], str | None] | None = None
    """config -> the module whose `warm()` loads the compiled kernels it drafts with (None:
    it drafts in Python); what `drafters.kernels.preload` loads beside the model."""

    def __post_init__(self) -> None:
        kind = self.config.model_fields.get("kind")
        if kind is None or not isinstance(kind.default, str):
            raise TypeError(f"{self.config.__name__} needs a `kind` field with a default")
        for name in [self.size_field] if self.size_field else []:
            if name not in self.config.model_fields:
                raise TypeError(f"{self.config.__name__} has no size field {name!r}")
        for m in self.methods:
            unknown = set(m.fields) - set(self.config.model_fields)
            if unknown:
                raise TypeError(f"method {m.name!r} sets unknown fields {sorted(unknown)}")
        methods = tuple(replace(m, kind=kind.default) for m in self.methods)
        object.__setattr__(self, "methods", methods)

    @property
    def kind(self) -> str:
        return self.config.model_fields["kind"].default
