"""Integration fixtures: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import pytest

from tts_service.config import ModelConfig
from tts_service.generation import Generator


@pytest.fixture(scope="session")
def smollm2() -> Generator:
    return Generator.load(ModelConfig(name="smollm2-135m", device="cpu", dtype="float32"))


@pytest.fixture(scope="session")
def ray_local():
    """One small private Ray on 127.0.0.1 for the session (declared GPUs stand in for real
    ones), whatever RAY_ADDRESS says."""
    import ray

    from actors.cluster import start_local

    started = not ray.is_initialized()
    if started:
        start_local(num_cpus=2, num_gpus=8, object_store_memory=300 * 1024**2, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2):
    """A seeded tiny random Llama with SmolLM2's tokenizer, saved like any local model."""
    import torch

    from tests.conftest import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = smollm2.loaded.tokenizer
    model = tiny_llama(vocab_size=len(tok), seed=0, dtype=torch.float32)
    model.config.eos_token_id = smollm2.loaded.eos_token_ids[0]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def refuse_to_start(monkeypatch) -> list[str]:
    """From now on Ray, the actors and the model loaders refuse to start (AssertionError);
    what tried to start is in the returned list: a check on what was started, not on time."""
    started: list[str] = []

    def refuse(what: str):
        def start(*_args, **_kwargs):
            started.append(what)
            raise AssertionError(f"{what} started")

        return start

    monkeypatch.setattr("jobs.common.init_ray", refuse("Ray"))
    monkeypatch.setattr("jobs.actor_set.init_ray", refuse("Ray"))
    monkeypatch.setattr("jobs.actor_set.JobActors.run", refuse("the actors"))
    monkeypatch.setattr("ray.init", refuse("ray.init"))
    for loader in ("tts_service.models.load_model", "tts_service.generation.load_model"):
        monkeypatch.setattr(loader, refuse("a model"))
    return started


def stop_served(proc, log) -> None:
    """Stop a `tts serve` subprocess as a user would (SIGTERM: it must exit 0 and say why not
    in its log), and kill its process group if it is still there (by PID)."""
    import os
    import signal

    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
