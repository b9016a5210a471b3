"""End-to-end load of the real SmolLM2-135M through the alias and its fp32 safetensors cache."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tts_service import models
from tts_service.config import ModelConfig
from tts_service.models import LoadedModel, encode_prompt, load_model

pytestmark = pytest.mark.slow

CFG = ModelConfig(name="smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("models")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 517 MB; pytest would keep three runs of it


@pytest.fixture(scope="module")
def loaded(cache_dir: Path) -> LoadedModel:
    """First load: dequantises the GGUF and writes the cache."""
    return load_model(CFG, cache_dir=cache_dir)  # a missing wheel fails, never skips


def _cache_entry(cache_dir: Path) -> Path:
    entries = list(cache_dir.iterdir())
    assert len(entries) == 1, entries  # no leftover temp dirs
    return entries[0]


def test_first_load_writes_cache(loaded: LoadedModel, cache_dir: Path) -> None:
    entry = _cache_entry(cache_dir)
    assert entry.name.startswith("smollm2-135m-")
    assert len(entry.name) == len("smollm2-135m-") + 16
    assert (entry / "model.safetensors").is_file()
    assert (entry / "tokenizer.json").is_file() or (entry / "tokenizer_config.json").is_file()


def test_second_load_reuses_cache(
    loaded: LoadedModel, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _cache_entry(cache_dir)
    mtime = entry.stat().st_mtime_ns

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was converted again despite a cache")

    monkeypatch.setattr(models, "_convert_gguf", fail)
    again = load_model(CFG, cache_dir=cache_dir)
    assert _cache_entry(cache_dir) == entry
    assert entry.stat().st_mtime_ns == mtime
    assert type(again.model).__name__ == "LlamaForCausalLM"


def test_model_shape_and_dtype(loaded: LoadedModel) -> None:
    model = loaded.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert loaded.dtype is torch.float32
    assert next(model.parameters()).dtype is torch.float32
    assert model.config.vocab_size == 49152
    assert loaded.device == torch.device("cpu")
    assert loaded.name == "smollm2-135m"
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in loaded.eos_token_ids
    assert len(set(loaded.eos_token_ids)) == len(loaded.eos_token_ids)


def test_encode_prompt(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    chat_ids = encode_prompt(tok, "What is the capital of France?", chat=True)
    assert isinstance(chat_ids, list) and all(type(i) is int for i in chat_ids)
    assert chat_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    plain_ids = encode_prompt(tok, "What is the capital of France?", chat=False)
    assert all(type(i) is int for i in plain_ids)
    assert tok.decode(plain_ids) == "What is the capital of France?"


def test_greedy_generation_knows_paris(loaded: LoadedModel) -> None:
    ids = encode_prompt(loaded.tokenizer, "What is the capital of France?", chat=True)
    with torch.no_grad():
        out = loaded.model.generate(
            torch.tensor([ids], device=loaded.device), max_new_tokens=8, do_sample=False
        )
    text = loaded.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in text
