"""`check_model`: whether a model can be loaded, answered before Ray or torch starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import constants

from tts_service import model_check
from tts_service.model_check import HubUnreachableError, ModelNotFoundError, check_model


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_typo_of_an_alias_names_the_alias_without_asking_the_hub(monkeypatch):
    monkeypatch.setattr(model_check, "_ask_hub", lambda name: pytest.fail("asked the hub"))
    with pytest.raises(ModelNotFoundError, match="Did you mean 'smollm2-135m'"):
        check_model("smollm2-136m")


def test_a_name_close_to_nothing_known_suggests_nothing(offline):
    with pytest.raises(HubUnreachableError) as far:
        check_model("gpt-oss-20x")
    assert "Did you mean" not in str(far.value)


def test_a_directory_needs_a_config(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="no weights"):
        check_model(str(tmp_path))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert check_model(str(tmp_path)) is None
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        check_model(str(tmp_path / "missing"))


def test_an_uncached_hub_id_offline_fails_here_and_warns_for_a_cluster(offline):
    name = "no-such-org/no-such-model"
    with pytest.raises(HubUnreachableError, match="HF_HUB_OFFLINE is set"):
        check_model(name)
    warning = check_model(name, here=False)
    assert warning is not None and name in warning and "actors' nodes" in warning


def test_a_cached_hub_id_passes_offline_and_is_suggested(monkeypatch, tmp_path: Path, offline):
    """A snapshot in the hub cache (HF_HUB_CACHE's layout) is enough; a typo of it is named."""
    repo = tmp_path / "models--org--reasoner-7b"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert check_model("org/reasoner-7b") is None
    with pytest.raises(ModelNotFoundError, match="Did you mean 'org/reasoner-7b'"):
        check_model("org/reasoner-7c")


def test_a_hub_that_says_no_is_not_a_warning(monkeypatch):
    """A 404 from the hub is an answer: refused even for a cluster's nodes."""

    def missing(name: str) -> None:
        raise ModelNotFoundError(f"model {name!r} not found (not on the hub)")

    monkeypatch.setattr(model_check, "_ask_hub", missing)
    with pytest.raises(ModelNotFoundError, match="not on the hub"):
        check_model("org/missing", here=False)
