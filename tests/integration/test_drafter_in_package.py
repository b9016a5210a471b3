"""A method is one file plus one line, for real: the diff docs/design.md shows under "Adding a
method" (a drafter module in `tts_service/drafters/` and its line in `DRAFTER_MODULES`),
applied to a copy of the repository's tracked files, passes the copy's whole unit suite (every
test parametrised from the registry runs the new method) and drafts nodes through `tts solve`,
greedy output equal to plain decoding's.

The diff is read from the doc, not restated here, so the doc's example is what is checked: a
registry that moved under it, a hunk that no longer applies, or an example that stops drafting
fails this. (`test_toy_drafter.py` checks the out-of-tree route, `TTS_DRAFTERS`, through a job
and Serve too.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import save_tiny_model
from tests.integration.test_toy_drafter import NEW_TOKENS, QUESTION

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
REGISTRY = "tts_service/drafters/registry.py"


def doc_diff() -> dict[str, tuple[str, str]]:
    """The diff under docs/design.md's "Adding a method": path -> (the text its hunk replaces,
    the text it puts there; '' for a new file's old text), hunk line counts checked where the
    header gives them."""
    doc = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = doc.split("\n## Adding a method\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```diff\n(.*?)^```", section, re.S | re.M)
    files = {}
    for part in re.split(r"^--- .*\n", block, flags=re.M)[1:]:
        header, at, *lines = part.splitlines()
        assert header.startswith("+++ b/") and at.startswith("@@"), (header, at)
        assert all(line[:1] in (" ", "+", "-") for line in lines), lines
        old = [line[1:] for line in lines if line[0] in " -"]
        new = [line[1:] for line in lines if line[0] in " +"]
        counts = re.match(r"@@ -\d+,(\d+) \+\d+,(\d+) @@", at)
        if counts:
            assert (len(old), len(new)) == tuple(map(int, counts.groups())), at
        files[header.removeprefix("+++ b/")] = ("\n".join(old), "\n".join(new))
    return files


def apply(root: Path, files: dict[str, tuple[str, str]]) -> None:
    """`doc_diff()` applied under `root`, failing loudly where a hunk's old text is not there
    exactly once (a new file must not exist yet)."""
    for path, (old, new) in files.items():
        target = root / path
        if not old:
            assert not target.exists(), f"the doc's new file {path} exists already"
            target.write_text(new + "\n", encoding="utf-8")
            continue
        text = target.read_text(encoding="utf-8")
        assert text.count(old) == 1, f"the doc's hunk does not apply to {path}:\n{old}"
        target.write_text(text.replace(old, new), encoding="utf-8")


@pytest.fixture(scope="module")
def added(tmp_path_factory) -> tuple[Path, str]:
    """(a copy of the repository's tracked files, as they are on disk, with the doc's diff
    applied; the method the diff adds). The diff is one new drafter module and one line more
    in the registry, nothing else."""
    files = doc_diff()
    (module,) = set(files) - {REGISTRY}
    assert set(files) == {module, REGISTRY} and module.startswith("tts_service/drafters/")
    old, new = (text.splitlines() for text in files[REGISTRY])
    assert len(new) == len(old) + 1 and all(line in new for line in old)  # one line added
    copy = tmp_path_factory.mktemp("repo")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted in the work tree is left out
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    apply(copy, files)
    (method,) = re.findall(r'Method\("([^"]+)"', files[module][1])
    return copy, method


def run(copy: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python *args` in the copy, importing the copy's code alone (no `TTS_DRAFTERS`, no
    outside PYTHONPATH, a private Ray), as the project's tests run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TTS_DRAFTERS")}
    env.update(
        PYTHONPATH=str(copy),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        RAY_AUTH_MODE="disabled",
    )
    argv = [sys.executable, *args]
    return subprocess.run(argv, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_whole_unit_suite_passes_with_the_method_added(added):
    copy, method = added
    probe = "from tts_service.drafters import registry as r; print(r.__file__, *r.METHODS)"
    seen = run(copy, "-c", probe, timeout=120)
    assert seen.returncode == 0, seen.stderr[-3000:]
    where, *methods = seen.stdout.split()
    assert Path(where).resolve().is_relative_to(copy.resolve()) and method in methods
    flags = ("-q", "-x", "-p", "no:cacheprovider", "--disable-warnings")
    proc = run(copy, "-m", "pytest", *flags, "tests/unit", timeout=3600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def _solve(copy: Path, model: Path, preset: Path, method: str, *flags: str) -> dict:
    argv = [
        "-m", "tts_service", "solve", "--config", str(preset), "--model", str(model),
        "--device", "cpu", "--dtype", "float64", "--method", method, *flags, "--n", "2",
        "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--no-chat", "--json", QUESTION,
    ]  # fmt: skip
    proc = run(copy, *argv, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_method_drafts_nodes_through_tts_solve_losslessly(added, tmp_path):
    """Every verify shape timed first (`cost_model: measured`): on this tiny model trees are
    then nearly free, so the method drafts, and what it drafts must change nothing."""
    copy, method = added
    model, preset = tmp_path / "model", tmp_path / "preset.yaml"
    save_tiny_model(model, 32, seed=5, scale=4.0, dtype=torch.float64)
    config = yaml.safe_load((copy / "configs" / "default.yaml").read_text(encoding="utf-8"))
    config["model"]["cost_model"] = "measured"
    preset.write_text(yaml.safe_dump(config), encoding="utf-8")
    plain = _solve(copy, model, preset, "plain")
    drafted = _solve(copy, model, preset, method, "--num-nodes", "3")
    assert drafted["stats"]["tree_nodes"] > 0  # it drafted

    def tokens(solved: dict) -> list[list[int]]:
        return [t["token_ids"] for t in solved["problems"][0]["trajectories"]]

    assert len(tokens(plain)) == 2 and len(tokens(plain)[0]) == NEW_TOKENS  # no EOS
    assert tokens(drafted) == tokens(plain)
