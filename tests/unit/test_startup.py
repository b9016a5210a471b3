"""The collector during a process's start-up (`tts_service.startup`): held while it starts,
then one collection, the survivors frozen, and collection again."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest

from tts_service import entry, startup
from tts_service.cli import replay, solve


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
    # nothing frozen again (a frozen object freed meanwhile, by another thread of a long test
    # process, lowers the count: seen once in a whole unit suite)
    assert gc.isenabled() and gc.get_freeze_count() <= frozen


def test_a_block_that_fails_while_held_turns_the_collector_back_on(collector):
    with pytest.raises(RuntimeError), startup.held():
        assert not gc.isenabled()
        raise RuntimeError("the model did not load")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_block_held_inside_an_outer_hold_leaves_it_to_the_outer_one(collector):
    with startup.held():
        with startup.held():  # e.g. an actor built while the process still starts
            assert not gc.isenabled()
        assert not gc.isenabled()  # still the outer hold's
    assert gc.isenabled()


def test_a_process_that_turned_the_collector_off_keeps_it_off(collector):
    gc.disable()
    with startup.held():
        startup.settle()
    assert not gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize(
    ("argv", "command", "held"),
    [
        (["replay", "--method", "pld", "--trajectories", "x.jsonl"], replay, False),
        (["solve", "What is 7 * 6?"], solve, True),
    ],
    ids=["replay", "solve"],
)
def test_the_tts_entry_holds_the_collector_until_the_command_has_started(
    collector, monkeypatch, argv, command, held
):
    """`tts` holds the collector from its first import; a command that builds no runner host
    runs with it settled (a replay runs long), one that does (`solve`) starts still held, for
    its host to settle; the collector is on when the command returns."""
    seen = []

    def run(args) -> int:
        seen.append(gc.isenabled())
        return 0

    run.__module__ = command.__name__
    monkeypatch.setattr(command, "run", run)
    monkeypatch.setattr(sys, "argv", ["tts", *argv])
    assert entry.main() == 0
    assert seen == [not held]
    assert gc.isenabled()
