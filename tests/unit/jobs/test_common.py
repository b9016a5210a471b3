"""`jobs.common.load_config`: the method sets the drafter over the preset, `auto` resolves for
the device the job runs on, and a --set still wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.common import JobInputError, load_config

PRESET = str(Path(__file__).resolve().parents[3] / "configs" / "best_of_16.yaml")


def test_the_method_sets_the_drafter_over_the_preset():
    assert load_config(PRESET, [], method="pld").drafter.kind == "pld"
    stand = load_config(PRESET, ["model.device=cpu"]).drafter  # the preset's auto, on a CPU
    assert (stand.kind, stand.tree, stand.num_nodes, stand.sizing) == (
        "stand",
        "stand-80",
        16,
        "fixed",
    )


def test_auto_resolves_for_the_device_a_set_asks_and_a_set_still_wins():
    gt = load_config(PRESET, ["model.device=cuda"]).drafter  # no CUDA needed to resolve it
    assert (gt.kind, gt.sizing, gt.num_nodes) == ("stand", "gt", 80)
    capped = load_config(PRESET, ["model.device=cuda", "drafter.num_nodes=32"]).drafter
    assert (capped.sizing, capped.num_nodes) == ("gt", 32)


def test_an_unknown_method_names_the_flag():
    with pytest.raises(JobInputError, match="--method: unknown 'medusa'"):
        load_config(PRESET, [], method="medusa")
