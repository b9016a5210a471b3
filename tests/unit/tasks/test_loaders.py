"""Benchmark loaders on the shipped fixtures: each dataset's own schema, the compressed test
encoding, LiveCodeBench releases, and errors that say how to get the data."""

from __future__ import annotations

import base64
import json
import pickle
import zlib

import pytest

from tts_service.tasks import loaders
from tts_service.tasks.items import TASK_NAMES
from tts_service.tasks.loaders import (
    FIXTURES_DIR,
    DatasetUnavailable,
    decode_tests,
    lcb_release_files,
    load_rows,
)


def test_fixtures_load_in_each_datasets_own_schema(items):
    rows = load_rows("lcb", "fixtures")
    assert {"question_content", "starter_code", "private_test_cases", "metadata"} <= set(rows[0])
    assert {"Question", "Correct Answer", "Record ID"} <= set(load_rows("gpqa", "fixtures")[0])
    assert {"id", "problem", "solution", "answer", "url", "year"} <= set(
        load_rows("aime24", "fixtures")[0]
    )
    assert all(len(items[t]) >= 10 for t in TASK_NAMES)
    kinds = {c.kind for item in items["lcb"] for c in item.tests}
    assert kinds == {"stdin", "functional"}
    # the private tests are stored in the real compressed encoding
    assert not rows[0]["private_test_cases"].lstrip().startswith("[")


def test_decoding_plain_json_and_the_compressed_encoding():
    cases = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}]
    text = json.dumps(cases)
    real = base64.b64encode(zlib.compress(pickle.dumps(text))).decode()
    assert decode_tests(text) == decode_tests(real) == cases
    assert decode_tests(base64.b64encode(zlib.compress(text.encode())).decode()) == cases
    assert decode_tests("") == []


def test_decoding_refuses_a_pickle_that_needs_a_global():
    class Evil:
        def __reduce__(self):
            return (print, ("this would run",))

    blob = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(ValueError, match="refusing to load global"):
        decode_tests(blob)
    with pytest.raises(ValueError, match="undecodable"):
        decode_tests("not base64 at all!")


def test_release_tags_resolve_to_the_scripts_files():
    assert lcb_release_files("release_v1") == ["test.jsonl"]
    assert lcb_release_files("release_v5")[-1] == "test5.jsonl"
    assert len(lcb_release_files("release_latest")) == 6
    assert lcb_release_files("v2_v3") == ["test2.jsonl", "test3.jsonl"]
    with pytest.raises(ValueError, match="unknown LiveCodeBench release"):
        lcb_release_files("release_v9")


@pytest.mark.parametrize("task", TASK_NAMES)
def test_an_unreachable_hub_says_how_to_get_the_data(task, monkeypatch):
    import datasets

    asked = []

    def unreachable(*args, **kwargs):
        asked.append((args, kwargs))
        raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DatasetUnavailable) as err:
        load_rows(task, "hub")
    message = str(err.value)
    assert "--data-files" in message and "HF_TOKEN" in message and "--data fixtures" in message
    assert {"aime24": "aime_2024", "gpqa": "gpqa", "lcb": "code_generation_lite"}[task] in message
    if task == "lcb":  # the release's files, read by the JSON builder
        assert asked[0][1]["data_files"][-1].endswith("code_generation_lite/test5.jsonl")
    if task == "gpqa":
        assert asked[0][0] == ("Idavidrein/gpqa", "gpqa_diamond")


def test_a_gated_dataset_without_a_token_is_a_clear_error(monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def gated(*args, **kwargs):
        raise DatasetNotFoundError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub.")

    monkeypatch.setattr(datasets, "load_dataset", gated)
    monkeypatch.setattr(loaders, "_hub_answers", lambda name, token: True)  # it answered 401
    with pytest.raises(DatasetUnavailable, match="gated dataset.*accepting the dataset's terms"):
        load_rows("gpqa", "hub")


def test_a_hub_that_does_not_answer_is_read_from_the_cache_without_retries(monkeypatch):
    """The hub's client retries an unreachable host for half a minute; a load after a probe
    that got no answer runs in offline mode (the cache answers at once, or the load fails)."""
    import datasets
    import datasets.config
    from huggingface_hub import constants

    seen = []

    def load(*args, **kwargs):
        seen.append((constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        raise FileNotFoundError("Dataset HuggingFaceH4/aime_2024 is not cached")

    monkeypatch.setattr(datasets, "load_dataset", load)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(loaders, "_hub_answers", lambda name, token: False)
    with pytest.raises(DatasetUnavailable, match="no answer, and no cached copy of .*aime_2024"):
        load_rows("aime24", "hub")
    assert seen == [(True, True)]  # offline for the load
    assert constants.HF_HUB_OFFLINE is False  # and back after it


def test_local_files_must_exist_and_carry_the_fields(tmp_path):
    with pytest.raises(DatasetUnavailable, match="no such file"):
        load_rows("aime24", "files", [tmp_path / "missing.jsonl"])
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "q", "answer": "1"}\n')
    with pytest.raises(DatasetUnavailable, match="lack the aime24 field"):
        load_rows("aime24", "files", [wrong])
    copy = tmp_path / "copy.jsonl"
    copy.write_text((FIXTURES_DIR / "aime24.jsonl").read_text())
    assert len(load_rows("aime24", "files", [copy])) == 12
