"""The drafter registry: every method names a registered family with its config model and
builds from its preset; missing resources are named, shared ones are shared."""

from __future__ import annotations

import pytest

from store.memory import InMemoryNgramStore
from tests.conftest import COPYING_KINDS, DRAFTER_CONFIGS
from tts_service.drafters.registry import DRAFTER_CONFIGS as CONFIG_MODELS
from tts_service.drafters.registry import KINDS, METHODS, DraftEnv, build_drafter
from tts_service.engine.cost import CostModel, VerifyCost


def test_every_method_names_a_registered_family_with_its_config_model():
    assert {m.kind for m in METHODS.values()} == set(KINDS) == set(CONFIG_MODELS)
    assert all(KINDS[k].config is CONFIG_MODELS[k] for k in KINDS)
    assert set(KINDS) >= COPYING_KINDS  # the harnesses' acceptance bars name real families


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_builds_from_its_preset(name):
    cfg = DRAFTER_CONFIGS[name]
    assert cfg.kind == METHODS[name].kind
    cost = CostModel.fixed(VerifyCost((1, 2), (1.0, 1.1), 64))
    drafter = build_drafter(cfg, DraftEnv(32, InMemoryNgramStore(), 0, cost))
    drafter.start([1, 2, 3])


def test_missing_resources_are_named():
    with pytest.raises(ValueError, match="logit n-gram store"):
        build_drafter(DRAFTER_CONFIGS["stand"], DraftEnv(32))
    with pytest.raises(ValueError, match="verify cost"):
        build_drafter(DRAFTER_CONFIGS["gtcp"], DraftEnv(32, InMemoryNgramStore()))


def test_shared_resources_are_shared_where_the_env_says():
    gen, problem = {}, {}
    env = DraftEnv(32, InMemoryNgramStore(), per_model=gen, per_problem=problem)
    a = build_drafter(DRAFTER_CONFIGS["recycle"], env)
    b = build_drafter(DRAFTER_CONFIGS["recycle"], DraftEnv(32, per_model=gen))
    assert a.table is b.table  # the hot start: one successor table per model
    s1 = build_drafter(DRAFTER_CONFIGS["stand+spine"], env)
    s2 = build_drafter(DRAFTER_CONFIGS["stand+spine"], env)
    assert s1.index is s2.index  # one exact-match index per problem
    other = build_drafter(DRAFTER_CONFIGS["stand+spine"], DraftEnv(32, InMemoryNgramStore()))
    assert other.index is not s1.index


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_field_num_nodes_sets_is_a_bounded_integer_of_the_kind(kind):
    """Derived from each spec, so a new drafter needs no line here: `--num-nodes` sets an
    integer field of the kind's config that has a lower bound (or the kind has none)."""
    from tts_service.drafters.registry import size_field

    field = size_field(kind)
    if field is None:
        return
    info = KINDS[kind].config.model_fields[field]
    assert info.annotation is int and any(getattr(m, "ge", None) for m in info.metadata)


OUT_OF_TREE = """
from typing import Literal

from tts_service.config import StrictConfig
from tts_service.drafters.base import NoDrafter
from tts_service.drafters.spec import DrafterSpec, Method, Shared

class EchoConfig(StrictConfig):
    kind: Literal["echo"] = "echo"
    num_nodes: int = 4

COUNTER = Shared("echo.counter", "problem", lambda cfg, vocab: [0])

def build(cfg, env):
    env.shared(COUNTER, cfg)[0] += 1
    return NoDrafter()

SPEC = DrafterSpec(EchoConfig, build, (Method("echo", "echo"),), "num_nodes", shared=(COUNTER,))
"""


def test_an_out_of_tree_module_is_one_spec_named_by_its_import_path(tmp_path, monkeypatch):
    from tts_service.drafters.registry import SPECS, _index, load_specs

    (tmp_path / "echo_drafter.py").write_text(OUT_OF_TREE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    (spec,) = load_specs(" echo_drafter, ")
    kinds = _index(SPECS + (spec,))
    assert kinds["echo"] is spec and spec.methods[0].kind == "echo"
    env = DraftEnv(8)
    spec.build(spec.config(), env)
    spec.build(spec.config(), env)
    assert list(env.per_problem.values()) == [[2]]  # made once, shared through the env
    with pytest.raises(ImportError, match="no SPEC"):
        load_specs("json")
    with pytest.raises(ValueError, match="registered twice"):
        _index(SPECS + (spec, spec))


def test_a_spec_is_checked_against_its_config():
    from tts_service.drafters.pld import PldDrafterConfig, PromptLookupDrafter
    from tts_service.drafters.spec import DrafterSpec, Method

    with pytest.raises(TypeError, match="no size field"):
        DrafterSpec(PldDrafterConfig, lambda c, e: PromptLookupDrafter(c), size_field="num_nodes")
    with pytest.raises(TypeError, match="unknown fields"):
        DrafterSpec(PldDrafterConfig, lambda c, e: None, (Method("x", "x", {"tree": "a"}),))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_what_a_spec_declares_it_needs_is_needed(name):
    from tts_service.drafters.registry import KINDS

    cfg, spec = DRAFTER_CONFIGS[name], KINDS[METHODS[name].kind]
    cost = CostModel.fixed(VerifyCost((1, 2), (1.0, 1.1), 64))
    if spec.uses_store:
        with pytest.raises(ValueError, match="logit n-gram store"):
            build_drafter(cfg, DraftEnv(32, None, 0, cost))
    else:
        build_drafter(cfg, DraftEnv(32, None, 0, cost))
    if spec.needs_cost and getattr(cfg, "sizing", "gt") == "gt":  # GTCP: GT always
        with pytest.raises(ValueError, match="verify cost"):
            build_drafter(cfg, DraftEnv(32, InMemoryNgramStore()))
    else:
        build_drafter(cfg, DraftEnv(32, InMemoryNgramStore()))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_method_s_drafter_config_names_the_method_back(name):
    """Outputs say `stand-dyn`, as users write it, not the kind `stand_dyn`."""
    from pydantic import TypeAdapter

    from tts_service.drafters.registry import DrafterConfig, method_drafter, method_name

    cfg = TypeAdapter(DrafterConfig).validate_python(method_drafter(name, {}, "cpu"))
    assert method_name(cfg) == name
