"""A method is one file: a toy drafter module written at test time, outside the repository,
named in `TTS_DRAFTERS`, runs with no other change through the CLI, a best-of-N job on Ray and
Serve, and (greedy) commits exactly what plain decoding does.

Each entry runs as its own process (the registry reads `TTS_DRAFTERS` when it is imported; a
private Ray's workers inherit the variable and the module's path from it). Every verify shape is
timed first (`cost_model: measured`): on this tiny model trees are then nearly free, so the toy
drafts, and a draft accepted or not must change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from store.local_server import free_port
from tests.conftest import save_tiny_model
from tests.integration.conftest import stop_served

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
QUESTION = "w3 w5 w1 w3 w5"
NEW_TOKENS = 16

TOY = '''"""Toy: drafts the last token repeated as a chain."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from tts_service.config import StrictConfig
from tts_service.engine.seam import DraftContext, Drafter, NodeTopK
from tts_service.drafters.spec import DrafterSpec, Method
from tts_service.engine.tree import DraftTree
from tts_service.engine.verify import Acceptance


class ToyDrafterConfig(StrictConfig):
    """Draft the last token `num_nodes` times."""

    kind: Literal["toy"] = "toy"
    num_nodes: int = Field(4, ge=1, le=64, description="Chain length drafted per step.")


class ToyDrafter(Drafter):
    def __init__(self, cfg: ToyDrafterConfig) -> None:
        self.cfg = cfg

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def draft(self, ctx: DraftContext) -> DraftTree:
        n = min(self.cfg.num_nodes, ctx.max_nodes)
        return DraftTree.chain(ctx.tokens[-1], [ctx.tokens[-1]] * n)

    def observe(self, tree: DraftTree, acc: Acceptance, topk: NodeTopK) -> None:
        pass

    def observe_root(self, tokens: Sequence[int], topk: NodeTopK) -> None:
        pass


SPEC = DrafterSpec(
    ToyDrafterConfig,
    lambda cfg, env: ToyDrafter(cfg),
    methods=(Method("toy", "toy: the last token repeated as a chain"),),
    size_field="num_nodes",
)
'''


FAULTY = TOY.replace('"""Toy: drafts the last token repeated as a chain."""', '"""Faulty."""')
FAULTY = FAULTY.replace("ToyDrafter", "FaultyDrafter").replace('"toy"', '"faulty"')
FAULTY = FAULTY.replace(
    "    def draft(self, ctx: DraftContext) -> DraftTree:\n",
    "    def draft(self, ctx: DraftContext) -> DraftTree:\n"
    "        self.drafts = getattr(self, 'drafts', 0) + 1\n"
    "        if self.drafts >= 2:\n"
    "            raise RuntimeError('injected fault in a drafter')\n",
)
FAULTY = FAULTY.replace(
    "toy: the last token repeated as a chain", "raises from its second draft on"
)
"""The toy, raising from its second draft on: a fault inside one row of a shared batch."""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(the model's directory, the environment naming the toy module, a CLI preset timing
    every verify shape) for a process."""
    tmp = tmp_path_factory.mktemp("toy")
    (tmp / "toy_drafter.py").write_text(TOY, encoding="utf-8")
    (tmp / "faulty_drafter.py").write_text(FAULTY, encoding="utf-8")
    model = tmp / "model"
    save_tiny_model(model, 32, seed=5, scale=4.0, dtype=torch.float64)
    preset = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    preset["model"]["cost_model"] = "measured"
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private Ray
    path = os.pathsep.join(p for p in (str(tmp), str(REPO), env.get("PYTHONPATH")) if p)
    env.update(
        PYTHONPATH=path,
        TTS_DRAFTERS="toy_drafter,faulty_drafter",
        HF_HUB_OFFLINE="1",
        RAY_AUTH_MODE="disabled",
    )
    return model, env, tmp / "preset.yaml"


def _solve(toy, method: str, *flags: str) -> dict:
    model, env, preset = toy
    argv = [
        sys.executable, "-m", "tts_service", "solve", "--config", str(preset),
        "--model", str(model), "--device", "cpu",
        "--dtype", "float64", "--method", method, *flags, "--n", "2", "--temperature", "0",
        "--max-new-tokens", str(NEW_TOKENS), "--no-chat", "--json", QUESTION,
    ]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def plain(toy) -> list[dict]:
    """Plain decoding's trajectories (greedy: both the same)."""
    (problem,) = _solve(toy, "plain")["problems"]
    out = problem["trajectories"]
    assert len(out) == 2 and len(out[0]["token_ids"]) == NEW_TOKENS  # no EOS: every token
    return out


def test_the_cli_runs_the_toy_method_losslessly(toy, plain):
    solved = _solve(toy, "toy", "--num-nodes", "3")  # its size field, set by the CLI flag
    assert solved["stats"]["tree_nodes"] > 0  # it drafted
    out = solved["problems"][0]["trajectories"]
    assert [t["token_ids"] for t in out] == [t["token_ids"] for t in plain]
    assert [t["text"] for t in out] == [t["text"] for t in plain]
    model, env, _ = toy
    argv = [sys.executable, "-m", "tts_service", "solve", "--method", "toy", "--tree", "x", "q"]
    bad = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--tree" in bad.stderr  # a flag the kind has no field for


def test_a_job_runs_the_toy_method_losslessly(toy, plain, tmp_path):
    model, env, _ = toy
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"id": "p", "question": QUESTION}) + "\n")
    sets = (
        f"model.name={model}", "model.device=cpu", "model.dtype=float64",
        "model.cost_model=measured", "n=2", "batch=2",
        "replicas=1", "cpus_per_replica=1", f"sampling.max_new_tokens={NEW_TOKENS}",
        "sampling.temperature=0", "chat=false",
    )  # fmt: skip
    argv = [
        sys.executable, "-m", "jobs.best_of_n", "--problems", str(problems),
        "--out", str(tmp_path / "out"), "--method", "toy", *(a for s in sets for a in ("--set", s)),
    ]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["settings"]["drafter"]["kind"] == "toy"
    records = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").open()]
    assert sum(r["stats"]["tree_nodes"] for r in records) > 0  # it drafted
    got = sorted((r["index"], r["token_ids"]) for r in records)
    assert got == [(t["index"], t["token_ids"]) for t in plain]


def _post(base: str, body: dict, route: str = "/v1/completions") -> tuple[int, dict]:
    req = urllib.request.Request(
        base + route,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served(toy, tmp_path_factory):
    """A `tts serve` process (its own private Ray) whose default method is the toy: its URL."""
    model, env, _ = toy
    tmp = tmp_path_factory.mktemp("served")
    port = free_port()
    config = tmp / "serve.yaml"
    app = {
        "name": "tts",
        "route_prefix": "/",
        "import_path": "tts_service.serve.app:app_builder",
        "args": {
            "model": {
                "name": str(model),
                "device": "cpu",
                "dtype": "float64",
                "cost_model": "measured",
            },
            "served_model_name": "tiny",
            "default_method": "toy",  # validated against the registry, the toy's included
            "drafters": {"toy": {"num_nodes": 3}, "faulty": {"num_nodes": 3}},
            "cpus_per_replica": 1,
            "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",  # /v1/solve
        },
    }
    http = {"host": "127.0.0.1", "port": port}
    config.write_text(yaml.safe_dump({"http_options": http, "applications": [app]}))
    log = tmp / "serve.log"
    argv = [sys.executable, "-m", "tts_service", "serve", "--config", str(config)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=out, stderr=out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 400
        while "tts: serving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_served(proc, log)


ASK = {"prompt": QUESTION, "max_tokens": NEW_TOKENS, "temperature": 0}


def test_serve_runs_the_toy_method_losslessly(served, plain):
    texts = {}
    for method in ("toy", None, "plain"):  # None: the default method, the toy
        body = {**ASK, "n": 2} if method is None else {**ASK, "n": 2, "spec_method": method}
        status, reply = _post(served, body)
        assert status == 200, reply
        texts[method] = [c["text"] for c in reply["choices"]]
    assert texts["toy"] == texts[None] == texts["plain"]
    assert texts["toy"] == [t["text"] for t in plain]


def _streamed(base: str, body: dict) -> str:
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        lines = [x.decode().strip() for x in r if x.strip()]
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def _failures(base: str) -> float:
    from tests.integration.test_serve_metrics import scrape

    key = ("tts_requests_total", (("route", "completions"), ("status", "500")))
    return scrape(base).get(key, 0.0)


def test_a_row_that_raises_fails_its_request_alone(served, plain):
    """A drafter raising inside a row (its second drafted step) beside a stream, a non-stream and a
    /v1/solve request, sent together so they share the batch: it is a counted 500, they
    answer what they answer alone."""
    before = _failures(served)
    alone = [t["text"] for t in plain][0]
    solve = {"question": QUESTION, "n": 2, "max_tokens": NEW_TOKENS, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        faulty = pool.submit(_post, served, {**ASK, "spec_method": "faulty"})
        streamed = pool.submit(_streamed, served, ASK)
        whole = pool.submit(_post, served, ASK)
        solved = pool.submit(_post, served, solve, "/v1/solve")
        status, reply = faulty.result()
        assert status == 500 and "injected fault in a drafter" in reply["error"]["message"]
        assert streamed.result() == alone
        assert whole.result()[0] == 200 and whole.result()[1]["choices"][0]["text"] == alone
        assert solved.result()[0] == 200 and solved.result()[1]["n"] == 2, solved.result()
    assert _failures(served) == before + 1
