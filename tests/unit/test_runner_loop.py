"""The runner's thread lets callers in between two steps: a request submitted while a long one
decodes joins at the next step, and a scoring chunk runs there, however busy the loop is."""

from __future__ import annotations

import threading
import time

from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS
from tests.unit.test_runner import make_generator
from tts_service.config import SamplingConfig
from tts_service.runner import RunnerLoop, TrajectoryRunner
from tts_service.trajectory import trajectory_requests

CALLS = 12


def _requests(problem_id: str, max_new_tokens: int):
    sampling = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return trajectory_requests(
        problem_id, [5, 9, 5, 9, 5], [0], sampling, DRAFTER_CONFIGS["plain"], InMemoryNgramStore()
    )


def test_a_caller_waits_at_most_the_step_in_progress(tiny_model):
    """A submit and a scoring chunk, each while a long row decodes: each waits for the step in
    progress at most (the stepping thread released its lock and took it again at once, so on a
    busy CPU a submit on SmolLM2 waited 62 forwards, 4.7 s)."""
    runner = TrajectoryRunner(make_generator(tiny_model), 4)
    loop = RunnerLoop(runner)
    forwards = runner.decoder.forwards
    done = threading.Event()  # the long row leaves at the test's end: no step outlives it
    long = loop.submit(_requests("long", 500), skip=lambda _req: done.is_set())  # a token a step
    while forwards.forwards < 3:  # the long row is decoding
        time.sleep(0.01)
    waited = []
    for k in range(CALLS):
        before = forwards.forwards
        short = loop.submit(_requests(f"short{k}", 1))
        submitted = forwards.forwards
        loop.between_steps(lambda: None)
        waited.append((submitted - before, forwards.forwards - submitted))
        short.wait(timeout=60)
    assert not long.done.is_set()  # every call above came while the long row decoded
    done.set()
    long.wait(timeout=60)
    assert max(max(w) for w in waited) <= 1, waited


class PacedRunner:
    """A runner whose first step lasts until the test releases it; then two more steps."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.release = threading.Event()
        self.steps = 0

    @property
    def idle(self) -> bool:
        return self.steps >= 3

    def tick(self) -> None:
        self.steps += 1
        self.events.append(f"step {self.steps}")
        if self.steps == 1:
            self.release.wait(10)

    def fail(self, error: BaseException) -> None:
        raise error


def test_a_caller_blocked_during_a_step_goes_before_the_next():
    """Deterministic: whoever waits for the lock while a step runs is let in at its end, before
    the loop's next step (the released lock was retaken by the stepping thread before a woken
    caller could run: on a busy CPU, for dozens of steps)."""
    runner = PacedRunner()
    loop = RunnerLoop(runner)  # type: ignore[arg-type]
    while runner.steps < 1:
        time.sleep(0.001)
    caller = threading.Thread(
        target=loop.between_steps, args=(lambda: runner.events.append("caller"),)
    )
    caller.start()
    while not loop._callers:  # the caller is waiting for the loop's lock
        time.sleep(0.001)
    runner.release.set()
    caller.join(10)
    while runner.steps < 3:  # the loop goes on after the caller
        time.sleep(0.001)
    assert runner.events == ["step 1", "caller", "step 2", "step 3"]
