"""The collector's passes off the decode step's critical path (`engine.collector`): a wide young
budget, and the pass CPython would run next, run while the device computes the forward."""

from __future__ import annotations

import gc

import pytest

from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS, FLAT_COST, tiny_llama
from tests.engine_loop import decode_rows
from tts_service.config import SamplingConfig
from tts_service.drafters.registry import DraftEnv, build_drafter
from tts_service.engine import batch as batch_module
from tts_service.engine import collector
from tts_service.engine.batch import BatchDecoder
from tts_service.engine.cost import CostModel


@pytest.fixture
def thresholds():
    """The process's thresholds and collector state, restored after the test."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*saved)
    if enabled:
        gc.enable()


class Box:
    """A container the collector tracks (lists would come from a free list, uncounted)."""


def spend(young: int) -> list[Box]:
    """`young` new container objects the collector tracks, kept alive."""
    return [Box() for _ in range(young)]


def test_widen_widens_the_young_budget_and_never_narrows_it(thresholds):
    gc.set_threshold(700, 10, 10)
    collector.widen()
    assert gc.get_threshold() == (collector.YOUNG, 10, 10)
    gc.set_threshold(4 * collector.YOUNG, 5, 7)
    collector.widen()
    assert gc.get_threshold() == (4 * collector.YOUNG, 5, 7)


def test_the_shadow_pass_waits_for_half_the_young_budget(thresholds):
    half = collector.YOUNG // 2
    gc.set_threshold(collector.YOUNG, 10, 10)
    gc.collect()  # every count zero
    assert collector.collect_in_shadow() is None  # nothing spent yet
    kept = spend(half + 100)
    assert gc.get_count()[0] >= half
    assert collector.collect_in_shadow() == 0
    assert gc.get_count()[0] < 100 and len(kept) == half + 100


def test_no_shadow_pass_under_cpythons_own_budget(thresholds):
    """Not widened (a process no runner host runs in), the automatic passes are the only ones."""
    gc.set_threshold(4000, 10, 10)
    gc.collect()
    kept = spend(3000)
    assert gc.get_count()[0] >= 2000
    assert collector.collect_in_shadow() is None and len(kept) == 3000


def test_the_shadow_pass_is_the_generation_cpython_would_collect_next(thresholds):
    gc.set_threshold(collector.YOUNG, 3, 2)
    gc.collect()  # every count zero
    seen = []
    for _ in range(20):
        kept = spend(collector.YOUNG // 2 + 100)
        seen.append(collector.collect_in_shadow())
        del kept
    # a middle pass once more than 3 young ones ran; a full one, at the next pass, once more
    # than 2 middle ones
    assert seen == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0]


def test_no_pass_while_the_collector_is_off(thresholds):
    gc.set_threshold(collector.YOUNG, 10, 10)
    gc.disable()
    kept = spend(collector.YOUNG // 2 + 100)
    assert collector.collect_in_shadow() is None and len(kept) == collector.YOUNG // 2 + 100


def test_a_decode_runs_its_passes_in_the_forwards_shadow(thresholds, monkeypatch):
    """With a young budget wider than two steps' allocations, no pass interrupts a step's host
    work: every pass during a step runs in the shadow, and some do; the output is unchanged."""
    model = tiny_llama(64, seed=3, scale=4.0)

    def decode() -> list[list[int]]:
        decoder = BatchDecoder(model, eos_ids=[])
        rows = []
        for i, prompt in enumerate(([1, 2, 3, 1, 2, 3], [5, 6, 7, 5], [9, 9, 4])):
            env = DraftEnv(64, InMemoryNgramStore(), i, CostModel.fixed(FLAT_COST))
            cfg = SamplingConfig(temperature=0.8, max_new_tokens=60, seed=i, ignore_eos=True)
            rows.append(decoder.new_row(prompt, build_drafter(DRAFTER_CONFIGS["stand"], env), cfg))
        return [r.token_ids for r in decode_rows(decoder, rows, token_budget=27)]

    expected = decode()
    where: list[str] = []
    state = {"at": "outside"}

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            where.append(state["at"])

    def in_shadow() -> int | None:
        state["at"] = "shadow"
        try:
            return collector.collect_in_shadow()
        finally:
            state["at"] = "step"

    step = BatchDecoder.step

    def stepping(self, *args, **kwargs):
        state["at"] = "step"
        try:
            return step(self, *args, **kwargs)
        finally:
            state["at"] = "outside"

    monkeypatch.setattr(batch_module, "collect_in_shadow", in_shadow)
    monkeypatch.setattr(BatchDecoder, "step", stepping)
    gc.set_threshold(collector.YOUNG, 10, 10)  # as a runner host widens it
    gc.collect()  # every count zero: nothing earlier tests left counts toward a pass
    kept = spend(collector.YOUNG // 2)  # half the budget spent: the first step's shadow passes
    gc.callbacks.append(record)
    try:
        assert decode() == expected
    finally:
        gc.callbacks.remove(record)
    assert "shadow" in where and "step" not in where and len(kept) == collector.YOUNG // 2
