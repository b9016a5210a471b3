"""Method names: the registry is the one list, so the edges (CLI, jobs, HTTP, tests) offer
exactly the registered names; each name builds its drafter fields, and `auto` follows the
device."""

from __future__ import annotations

from typing import get_args

import pytest

from tests.conftest import DRAFTER_CONFIGS
from tts_service.drafters.registry import (
    AUTO_FIELDS,
    AUTO_METHOD,
    METHOD_NAMES,
    METHODS,
    MethodName,
    method_drafter,
)
from tts_service.serve.api import CompletionRequest


def test_the_edges_offer_exactly_the_registered_names():
    assert get_args(MethodName) == METHOD_NAMES == (*METHODS, "auto")
    field = CompletionRequest.model_fields["spec_method"]
    assert set(get_args(field.annotation)) - {type(None)} == {MethodName}
    assert set(METHODS) <= set(DRAFTER_CONFIGS)  # the tests' parameters cover every method


def test_method_names_build_their_drafter_fields_and_auto_follows_the_device():
    preset = {"stand": {"num_nodes": 16, "tree": "stand-80"}}
    assert method_drafter("stand-gt", preset, "cuda") == {
        "kind": "stand",
        "num_nodes": 80,  # GT decides the size; the whole tree is the cap
        "tree": "stand-80",
        "sizing": "gt",
    }
    # a kind's device default (`stand` in Python on a CPU), beneath the user's preset
    assert method_drafter("stand-gt", preset, "cpu") == {
        **method_drafter("stand-gt", preset, "cuda"),
        "compiled": False,
    }
    assert method_drafter("stand", {"stand": {"compiled": True}}, "cpu")["compiled"]
    assert method_drafter("stand+spine", {})["kind"] == "stand_spine"
    cpu, gpu = method_drafter("auto", {}, "cpu"), method_drafter("auto", {}, "cuda:1")
    assert cpu == {**method_drafter(AUTO_METHOD["cpu"], {}), **AUTO_FIELDS["cpu"]}
    assert gpu == {**method_drafter(AUTO_METHOD["cuda"], {}), **AUTO_FIELDS["cuda"]}
    assert cpu["drawn"] and "drawn" not in gpu  # drawn children: auto's CPU default only
    # the user's preset wins over auto's device default; a named method gets none
    assert not method_drafter("auto", {"stand_dyn": {"drawn": False}}, "cpu")["drawn"]
    assert "drawn" not in method_drafter("stand-dyn", {}, "cpu")
    with pytest.raises(ValueError, match="unknown method"):
        method_drafter("eagle", {})
