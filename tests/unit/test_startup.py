"""The collector during a process's start-up (`tts_service.startup`): held while it starts,
then one collection, the survivors frozen, and collection again."""

from __future__ import annotations

import gc
import weakref

import pytest

from tts_service import startup


class Node:
    """A container the collector tracks (a reference cycle when it points at itself)."""

    other: object = None


@pytest.fixture
def collector(monkeypatch):
    """The collector on and this process not yet settled, before and after each test."""
    assert gc.isenabled()
    monkeypatch.setattr(startup, "_frozen", False)
    yield
    gc.unfreeze()
    gc.enable()


def test_settle_collects_what_start_up_left_over_and_freezes_the_rest(collector):
    startup.hold()
    assert not gc.isenabled()
    garbage = Node()
    garbage.other = garbage  # a cycle: only a collection frees it
    gone = weakref.ref(garbage)
    del garbage
    live = Node()
    assert gone() is not None
    startup.settle()
    assert gc.isenabled()
    assert gone() is None  # collected, not frozen
    assert gc.get_freeze_count() > 0 and live.other is None
    frozen = gc.get_freeze_count()
    with startup.held():  # a second host in the process: held, then on again, nothing frozen
        assert not gc.isenabled()
        Node()
        startup.settle()
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_block_that_fails_while_held_turns_the_collector_back_on(collector):
    with pytest.raises(RuntimeError), startup.held():
        assert not gc.isenabled()
        raise RuntimeError("the model did not load")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_process_that_turned_the_collector_off_keeps_it_off(collector):
    gc.disable()
    with startup.held():
        startup.settle()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
