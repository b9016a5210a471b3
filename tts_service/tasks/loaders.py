"""Benchmark rows, in each dataset's own schema, from the Hugging Face Hub, from local files, or
from the small fixture sets shipped here; all three go through `datasets`.

Sources: AIME-2024 is `HuggingFaceH4/aime_2024`; GPQA-Diamond is `Idavidrein/gpqa`, config
`gpqa_diamond`, which is gated (accept its terms on the Hub, then log in or set HF_TOKEN);
LiveCodeBench is `livecodebench/code_generation_lite`. That last repository is built around a
loading script that takes `version_tag=`, and `datasets` >= 4 no longer runs loading scripts, so
a release tag is resolved here to the script's own list of cumulative JSONL files, which the
JSON builder reads into the same rows.

LiveCodeBench stores private tests as base64(zlib(pickle(JSON text))). Unpickling untrusted
data can run arbitrary code, so the pickle layer is read by an unpickler that refuses every
global: it can rebuild strings, numbers and containers and nothing else. That path is only taken
for the real encoding; plain JSON is read as JSON.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pickle
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tts_service.model_check import HUB_TIMEOUT_S
from tts_service.tasks.items import TaskName, TestCase

DataSource = Literal["hub", "fixtures", "files"]
FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
DEFAULT_RELEASE = "release_v5"
_MAX_TESTS_BYTES = 1 << 30  # a decompressed private-test blob larger than this is refused


class DatasetUnavailable(ValueError):
    """The rows cannot be loaded; the message names the dataset and how to get it."""


@dataclass(frozen=True)
class HubDataset:
    name: str
    config: str | None
    split: str
    fixture: str  # file name under fixtures/
    fields: tuple[str, ...]  # what the prompt and the grader read


DATASETS: dict[TaskName, HubDataset] = {
    "aime24": HubDataset(
        "HuggingFaceH4/aime_2024", None, "train", "aime24.jsonl", ("problem", "answer")
    ),
    "gpqa": HubDataset(
        "Idavidrein/gpqa",
        "gpqa_diamond",
        "train",
        "gpqa_diamond.jsonl",
        (
            "Question",
            "Correct Answer",
            "Incorrect Answer 1",
            "Incorrect Answer 2",
            "Incorrect Answer 3",
            "Record ID",
        ),
    ),
    "lcb": HubDataset(
        "livecodebench/code_generation_lite",
        None,
        "test",
        "lcb.jsonl",
        (
            "question_id",
            "question_content",
            "starter_code",
            "public_test_cases",
            "private_test_cases",
            "metadata",
        ),
    ),
}

_LCB_FILES = ("test.jsonl", *(f"test{i}.jsonl" for i in range(2, 7)))
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def lcb_release_files(tag: str) -> list[str]:
    """The JSONL files of a LiveCodeBench release, as its loading script lists them.

    `release_vK` is cumulative (files 1..K), `release_latest` is every file, `vK` is release K's
    own file and `vA_vB` the files A..B.

    Raises:
        ValueError: an unknown tag (the message lists the forms).
    """
    if tag == "release_latest":
        return list(_LCB_FILES)
    if m := re.fullmatch(r"release_v([1-6])", tag):
        return list(_LCB_FILES[: int(m.group(1))])
    if m := re.fullmatch(r"v([1-6])(?:_v([1-6]))?", tag):
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if first <= last:
            return list(_LCB_FILES[first - 1 : last])
    raise ValueError(
        f"--release: unknown LiveCodeBench release {tag!r} "
        "(release_v1..release_v6, release_latest, v1..v6 or vA_vB)"
    )


def _hub_help(task: TaskName, cause: BaseException) -> str:
    ds = DATASETS[task]
    name = ds.name + (f" (config {ds.config})" if ds.config else "")
    first = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else ""
    return (
        f"cannot load {name} from the Hugging Face Hub ({type(cause).__name__}: {first}). "
        "Pass --data-files with a local copy that has the same fields, or set HF_TOKEN (after "
        "accepting the dataset's terms on its Hub page if it is gated) with network access, or "
        "use --data fixtures for the small offline set shipped with tts-service"
    )


def _from_hub(task: TaskName, release: str, token: str | None):
    """The task's rows from the hub; when it does not answer within `HUB_TIMEOUT_S` (its client
    would retry for half a minute), from the local datasets cache, failing at once without."""
    from datasets import load_dataset

    ds = DATASETS[task]
    files = lcb_release_files(release) if task == "lcb" else []  # a bad tag fails before I/O
    reachable = _hub_answers(ds.name, token)
    try:
        with contextlib.nullcontext() if reachable else _offline():
            if task == "lcb":
                urls = [f"hf://datasets/{ds.name}/{f}" for f in files]
                return load_dataset("json", data_files=urls, split="train", token=token)
            return load_dataset(ds.name, ds.config, split=ds.split, token=token)
    except Exception as e:  # the Hub stack raises OS, HTTP-client and datasets errors alike
        cause = e if reachable else ConnectionError(f"no answer, and no cached copy of {ds.name}")
        raise DatasetUnavailable(_hub_help(task, cause)) from e


def _hub_answers(name: str, token: str | None) -> bool:
    """Whether the hub answers about dataset `name` within `HUB_TIMEOUT_S` (an HTTP error is
    an answer: the load then says what is wrong); under HF_HUB_OFFLINE, as if it did (the
    datasets library reads its cache itself)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return True
    try:
        HfApi(token=token).dataset_info(name, timeout=HUB_TIMEOUT_S)
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001 - no network: every transport's own error type
        return False
    return True


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """The hub and datasets libraries in offline mode for one load (the cache answers)."""
    import datasets.config
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = before


def _from_files(paths: list[Path], where: str):
    from datasets import load_dataset

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DatasetUnavailable(f"{where}: no such file: {', '.join(missing)}")
    builders = {_BUILDERS.get(p.suffix.lower()) for p in paths}
    if None in builders or len(builders) != 1:
        raise DatasetUnavailable(
            f"{where}: expected files of one kind: .jsonl/.json, .parquet or .csv"
        )
    try:
        return load_dataset(builders.pop(), data_files=[str(p) for p in paths], split="train")
    except Exception as e:  # malformed files surface as builder-specific errors
        raise DatasetUnavailable(f"{where}: cannot read: {type(e).__name__}: {e}") from e


def load_rows(
    task: TaskName,
    source: DataSource,
    data_files: list[Path] | None = None,
    release: str = DEFAULT_RELEASE,
    token: str | None = None,
) -> list[dict]:
    """Every row of the task's dataset, as plain dicts in the dataset's own schema.

    Args:
        source: "hub" (the named Hub dataset; `release` picks LiveCodeBench's files and `token`
            defaults to the Hub's own login), "fixtures" (shipped here), or "files"
            (`data_files`, local copies with the same fields).

    Raises:
        DatasetUnavailable: missing, unreachable, gated without a token, or lacking fields.
        ValueError: an unknown LiveCodeBench release.
    """
    if source == "hub":
        where = DATASETS[task].name
        dataset = _from_hub(task, release, token)
    elif source == "fixtures":
        where = f"the {task} fixtures"
        dataset = _from_files([FIXTURES_DIR / DATASETS[task].fixture], where)
    else:
        where = "--data-files"
        if not data_files:
            raise DatasetUnavailable("--data-files: give at least one file")
        dataset = _from_files(data_files, where)
    rows = [dict(r) for r in dataset]
    if not rows:
        raise DatasetUnavailable(f"{where}: no rows")
    missing = [f for f in DATASETS[task].fields if f not in rows[0]]
    if missing:
        raise DatasetUnavailable(f"{where}: rows lack the {task} field(s) {', '.join(missing)}")
    return rows


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global, so a payload can only rebuild plain values, never run code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def _inflate(blob: bytes) -> bytes:
    inflater = zlib.decompressobj()
    data = inflater.decompress(blob, _MAX_TESTS_BYTES)
    if inflater.unconsumed_tail:
        raise ValueError(f"test cases larger than {_MAX_TESTS_BYTES} bytes once decompressed")
    return data


def decode_tests(raw: str) -> list[dict]:
    """LiveCodeBench test cases from plain JSON or the compressed base64/zlib/pickle encoding.

    Raises:
        ValueError: neither encoding, a pickle that needs a global, or not a JSON list.
    """
    text = raw.strip()
    if not text:
        return []
    if not text.startswith("["):
        try:
            payload = _inflate(base64.b64decode(text, validate=True))
            if payload[:1] == b"\x80":  # a pickle protocol header: the real set's encoding
                text = _PlainUnpickler(io.BytesIO(payload)).load()
            else:
                text = payload.decode("utf-8")
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
            raise ValueError(f"undecodable test cases: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"test cases decode to {type(text).__name__}, not JSON text")
    cases = json.loads(text)
    if not isinstance(cases, list):
        raise ValueError("test cases are not a JSON list")
    return cases


def lcb_tests(row: dict) -> tuple[TestCase, ...]:
    """Public then private tests of a LiveCodeBench row.

    Raises:
        ValueError: undecodable tests or an unknown `testtype`.
    """
    cases = [*decode_tests(row["public_test_cases"]), *decode_tests(row["private_test_cases"])]
    out = []
    for case in cases:
        kind = case.get("testtype")
        if kind not in ("stdin", "functional"):
            raise ValueError(f"{row['question_id']}: unknown testtype {kind!r}")
        out.append(TestCase(str(case["input"]), str(case["output"]), kind))
    return tuple(out)
