"""A process's start-up without the cyclic garbage collector's passes over it.

Start-up (imports, the model, the tokenizer, Ray's client) makes ~400k-500k objects that live
as long as the process, and the collector's full passes over them grow with them: on a 2-core
CPU `tts solve` ran 7 before it decoded, 13 to 212 ms each (0.73 s of a 4.7 s set-up), the
best-of-N job's driver 7 (0.78 s, before Ray started) and its generator actor 8 (0.73 s). So a
process holds the collector while it starts (`hold`), and when it is up (a runner host built,
or a driver's imports done) collects once and freezes what survived (`settle`: `gc.freeze`, as
vLLM does once its engine is up): frozen objects are never scanned again, so a later full pass
scans only what came after, and a long decode is not stalled by passes over the model's
objects. docs/benchmarks.md ("Start-up") has the figures.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_held = False
_frozen = False


@contextmanager
def held() -> Iterator[None]:
    """`hold` for the block; at its end (an error included) the collector runs again if nothing
    settled it (a runner host built inside it settles: `actors.host.RunnerHost`). Inside an
    outer hold it changes nothing: the outer one ends it."""
    mine = hold()
    try:
        yield
    finally:
        if mine:
            release()


def hold() -> bool:
    """Stop the collector until `settle` (or `release`); whether this call stopped it (not if
    it is already off: held already, or the process's own choice, which `settle` then leaves
    as it is)."""
    global _held
    if not gc.isenabled():
        return False
    gc.disable()
    _held = True
    return True


def settle() -> None:
    """Start-up is over: collect once (its garbage, reference cycles included: nothing is
    frozen that only a collection would free), freeze what is left, and collect from here on.
    Once per process (a process that builds several hosts, the tests', freezes at the first
    only); nothing where `hold` did not stop the collector."""
    global _held, _frozen
    if _held:
        if not _frozen:
            gc.collect()
            gc.freeze()
            _frozen = True
        gc.enable()
        _held = False


def release() -> None:
    """Collect again from here on, freezing nothing (a command that ends without starting)."""
    global _held
    if _held:
        gc.enable()
        _held = False


def exiting() -> None:
    """The process is ending: freeze every object, so that the interpreter's last collection
    at exit scans none of them (the OS takes the memory back). Without it `tts --help` spent
    ~0.15 s of its ~0.8 s in that collection, over the objects of the imports its flags need."""
    gc.freeze()
