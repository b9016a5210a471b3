"""One row's failure fails its own request alone: a drafter that raises, a stop rule (its
commit callback) that raises, or a deferred observation that raises, beside other requests in
the same batch, which finish with the tokens they would have had alone."""

from __future__ import annotations

import pytest

from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS
from tests.unit.test_runner import make_generator
from tts_service.config import SamplingConfig
from tts_service.engine.decode import plain_generate
from tts_service.engine.seam import Drafter
from tts_service.runner import TrajectoryRunner
from tts_service.trajectory import TrajectoryRequest

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


class Faulty:
    """A drafter that raises in `method` from its `after`-th call on; otherwise `inner`."""

    def __init__(self, inner: Drafter, method: str, after: int = 2) -> None:
        self.inner, self.method, self.after, self.calls = inner, method, after, 0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def call(*args, **kwargs):
            self.calls += 1
            if self.calls >= self.after:
                raise RuntimeError(f"injected fault in {name}")
            out = attr(*args, **kwargs)
            if name == "observe" and out is not None:  # the deferred part raises instead
                return lambda: (_ for _ in ()).throw(RuntimeError("injected deferred fault"))
            return out

        return call


def request(i: int, prompt: list[int], **kw) -> TrajectoryRequest:
    store = InMemoryNgramStore()
    return TrajectoryRequest("p", i, prompt, GREEDY, DRAFTER_CONFIGS["stand"], store, **kw)


def boom(tokens) -> bool:
    """A commit callback (part of the row's stop rule) that raises at its third step."""
    boom.calls += 1
    if boom.calls >= 3:
        raise RuntimeError("injected fault in the stop rule")
    return True


@pytest.mark.parametrize("fault", ["draft", "observe", "stop rule"])
def test_a_failing_row_fails_its_own_request_alone(tiny_model, fault):
    runner = TrajectoryRunner(make_generator(tiny_model), 4)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9, 3], [11, 12, 13]]
    boom.calls = 0
    if fault == "stop rule":
        bad = request(0, prompts[0], on_commit=boom)
    else:
        bad = request(0, prompts[0], wrap=lambda d: Faulty(d, fault))
    failing = runner.submit([bad])
    others = [runner.submit([request(i, p)]) for i, p in enumerate(prompts[1:], 1)]
    stream = runner.submit([request(3, prompts[0])])  # the same prompt as the failing row
    while not all(s.done.is_set() for s in [failing, *others, stream]):
        runner.tick()
    with pytest.raises(RuntimeError, match="injected"):
        failing.wait()
    for sub in [*others, stream]:
        res = sub.wait().results[0]
        ref = plain_generate(tiny_model, res.request.prompt_ids, GREEDY, eos_ids=[])
        assert res.output.token_ids == ref.token_ids
    assert runner.decoder.active == []  # the failed row left the batch
