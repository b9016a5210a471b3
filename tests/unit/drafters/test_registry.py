"""The drafter registry: every method names a registered family with its config model and
builds from its preset; missing resources are named, shared ones are shared."""

from __future__ import annotations

import pytest

from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS
from tts_service.config import DRAFTER_CONFIGS as CONFIG_MODELS
from tts_service.drafters.methods import METHODS
from tts_service.drafters.registry import KINDS, DraftEnv, build_drafter
from tts_service.engine.cost import CostModel, VerifyCost


def test_every_method_names_a_registered_family_with_its_config_model():
    assert {m.kind for m in METHODS.values()} == set(KINDS) == set(CONFIG_MODELS)
    assert all(KINDS[k].config is CONFIG_MODELS[k] for k in KINDS)


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
    env = DraftEnv(32, InMemoryNgramStore(), generator=gen, problem=problem)
    a = build_drafter(DRAFTER_CONFIGS["recycle"], env)
    b = build_drafter(DRAFTER_CONFIGS["recycle"], DraftEnv(32, generator=gen))
    assert a.table is b.table  # the hot start: one successor table per model
    s1 = build_drafter(DRAFTER_CONFIGS["stand+spine"], env)
    s2 = build_drafter(DRAFTER_CONFIGS["stand+spine"], env)
    assert s1.index is s2.index  # one exact-match index per problem
    other = build_drafter(DRAFTER_CONFIGS["stand+spine"], DraftEnv(32, InMemoryNgramStore()))
    assert other.index is not s1.index
