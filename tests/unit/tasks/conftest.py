"""The benchmark items built from the shipped fixtures, shared by the loader, prompt and grading
tests."""

from __future__ import annotations

import pytest

from tts_service.tasks.items import TASK_NAMES
from tts_service.tasks.loaders import load_rows
from tts_service.tasks.prompts import build_items


@pytest.fixture(scope="module")
def items():
    return {t: build_items(t, load_rows(t, "fixtures"), run_seed=0) for t in TASK_NAMES}
