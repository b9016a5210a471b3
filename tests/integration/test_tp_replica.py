"""A tensor-parallel replica on Ray: 2 rank actors in one STRICT_PACK group (gloo, CPU, fp32)
generate token for token what one process decodes plainly."""

from __future__ import annotations

import pytest

from actors.tp import TensorParallelReplica
from tests.conftest import DRAFTER_CONFIGS
from tts_service.config import ModelConfig, SamplingConfig
from tts_service.engine.decode import plain_generate
from tts_service.generation import Generator

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def replica(ray_local, tiny_model_dir):
    cfg = ModelConfig(name=str(tiny_model_dir), device="cpu", dtype="float32")
    replica = TensorParallelReplica(cfg, ranks=2)
    yield replica
    replica.close()


@pytest.mark.parametrize("method", ["stand", "pld"])
def test_two_rank_replica_equals_plain_single_process(replica, tiny_model_dir, method):
    sampling = SamplingConfig(temperature=0, max_new_tokens=24)
    out = replica.generate(PROMPT, DRAFTER_CONFIGS[method], sampling)
    single = Generator.load(ModelConfig(name=str(tiny_model_dir), device="cpu", dtype="float32"))
    ids = single.encode(PROMPT, chat=False)
    plain = plain_generate(single.loaded.model, ids, sampling, single.loaded.eos_token_ids)
    assert out["token_ids"] == list(plain.token_ids)
    assert out["stats"]["target_forwards"] <= len(plain.token_ids)
