"""Integration fixtures: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import pytest

from tts_service.config import ModelConfig
from tts_service.generation import Generator


@pytest.fixture(scope="session")
def smollm2() -> Generator:
    return Generator.load(ModelConfig(name="smollm2-135m", device="cpu", dtype="float32"))
