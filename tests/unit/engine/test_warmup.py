"""A compiled forward is compiled before decoding, announced on stderr, and decodes as plain
greedy does; `compile` needs the compact forward; a server warms nothing it does not need."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from actors.host import RunnerHost
from store.memory import InMemoryNgramStore
from tests.conftest import DRAFTER_CONFIGS, tiny_llama
from tests.unit.test_runner import _prompts, make_generator
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.engine.compact import CompactCausalLM
from tts_service.engine.decode import plain_generate
from tts_service.engine.warmup import COMPILED_SHAPES, warm_shapes
from tts_service.trajectory import TrajectoryRequest


def test_compile_needs_the_compact_forward():
    with pytest.raises(ValidationError, match="compile: needs forward: compact"):
        ModelConfig(compile=True)
    assert ModelConfig(forward="compact", compile=True).compile


def test_a_compiled_forward_is_warmed_announced_and_decodes_as_plain_greedy(capsys):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32, scale=8.0)
    compact = CompactCausalLM(copy.deepcopy(model))
    compact.compile()
    host = RunnerHost(make_generator(compact), max_rows=4)
    err = capsys.readouterr().err
    assert "[tts] compiling the forward (torch.compile, kept in " in err
    assert f"for {len(COMPILED_SHAPES)} step shapes ..." in err and "[tts] forward ready in" in err
    decoder = host.runner.decoder
    assert not decoder.active and decoder.cache.rows == decoder.cache.length == 0
    store, requests, refs = InMemoryNgramStore(), [], []
    for i, prompt in enumerate(_prompts()[:3]):
        cfg = SamplingConfig(temperature=0, max_new_tokens=12, seed=i)
        requests.append(TrajectoryRequest("p", i, prompt, cfg, DRAFTER_CONFIGS["stand"], store))
        refs.append(plain_generate(model, prompt, cfg, eos_ids=[]).token_ids)
    report = host.run(requests)
    got = {r.request.index: r.output.token_ids for r in report.results}
    assert [got[i] for i in range(3)] == refs


def test_an_eager_forward_on_a_cpu_warms_nothing(capsys):
    model = tiny_llama(vocab_size=64, seed=0, dtype=torch.float32)
    host = RunnerHost(make_generator(model), max_rows=4, warm=True)
    assert warm_shapes(host.runner.decoder, 4) == []
    assert "step shapes" not in capsys.readouterr().err
