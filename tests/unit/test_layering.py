"""The layering rules, checked for every module (imports inside functions included).

Data flows one way: edge (CLI, jobs, Serve) -> actors (the runner host) -> runner -> engine ->
store. The core (engine, drafters, aggregate, config, the runner and its glue) never imports
Ray, Redis, HTTP, the actors, an edge or the edges' schemas, never opens a store (only the
store's types: `store.base`, `store.config`) and never imports the tools built on it (replay,
tree calibration), which may open in-process stores; the store never imports the service; an
edge never
imports another edge (the CLI is the launcher: it may start Serve and submit jobs). The edges'
schemas (`tts_service.schemas`) sit between: they embed the drafter registry's configs and
import nothing of the I/O, the actors or an edge. `tts_service.config` imports no drafter and no
schema (the drafters import it: the registry derives the config union from them), and the engine
imports no drafter: it owns the seam the drafters implement (`tts_service.engine.seam`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tts_service", "actors", "jobs", "store")
IO = ("ray", "redis", "fastapi", "starlette", "uvicorn")
EDGES = ("jobs", "tts_service.serve", "tts_service.cli")
CORE = (
    "tts_service.engine",
    "tts_service.drafters",
    "tts_service.aggregate",
    "tts_service.config",
    "tts_service.tasks",
    "tts_service.models",
    "tts_service.generation",
    "tts_service.runner",
    "tts_service.trajectory",
    "tts_service.solve",
)
TOOLS = ("tts_service.replay", "tts_service.calibrate")  # over the core: logs, calibration
# the store's types, and the arrays compiled drafting reads (no I/O): the core opens no store
CORE_STORE = ("store.base", "store.config", "store.index", "store.indexed", "store.hashtable")
TOOLS_STORE = CORE_STORE + ("store.memory",)  # tools may open an in-process store
SCHEMAS = ("tts_service.schemas",)
CONFIG = ("tts_service.config",)
ENGINE = ("tts_service.engine",)  # owns the drafter seam (engine/seam.py): drafters import it


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(module: str) -> list[str]:
    imports = _imports(MODULES[module])
    bad = []
    if _within(module, CORE):
        bad += [i for i in imports if _within(i, IO + EDGES + ("actors",) + SCHEMAS + TOOLS)]
        bad += [i for i in imports if _within(i, ("store",)) and not _within(i, CORE_STORE)]
    if _within(module, TOOLS):
        bad += [i for i in imports if _within(i, IO + EDGES + ("actors",) + SCHEMAS)]
        bad += [i for i in imports if _within(i, ("store",)) and not _within(i, TOOLS_STORE)]
    if _within(module, CONFIG + ENGINE):
        bad += [i for i in imports if _within(i, ("tts_service.drafters",))]
    if _within(module, SCHEMAS):
        bad += [i for i in imports if _within(i, IO + EDGES + ("actors",))]
        bad += [i for i in imports if _within(i, ("store",)) and not _within(i, CORE_STORE)]
    if _within(module, ("store",)):
        bad += [i for i in imports if _within(i, ("tts_service", "actors") + EDGES)]
    if _within(module, ("actors",)):
        bad += [i for i in imports if _within(i, EDGES)]
    for edge in EDGES[:2]:  # jobs and Serve: neither imports the other, nor the CLI
        if _within(module, (edge,)):
            bad += [i for i in imports if _within(i, EDGES) and not _within(i, (edge,))]
    return sorted(bad)


def test_the_rules_see_every_package():
    assert {m.split(".")[0] for m in MODULES} == set(PACKAGES) and len(MODULES) > 40
    assert all(any(_within(m, (p,)) for m in MODULES) for p in CORE + EDGES + SCHEMAS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_respects_the_layering(module):
    assert _violations(module) == []


def test_a_violation_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import ray\n    from actors.pool import GeneratorPool\n")
    monkeypatch.setitem(MODULES, "tts_service.engine.bad", bad)
    assert _violations("tts_service.engine.bad") == ["actors.pool", "ray"]


def test_config_importing_a_drafter_or_a_schema_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from tts_service.drafters.registry import DrafterConfig\n"
        "def f():\n    from tts_service.schemas import JobConfig\n"
    )
    monkeypatch.setitem(MODULES, "tts_service.config.bad", bad)
    assert _violations("tts_service.config.bad") == [
        "tts_service.drafters.registry",
        "tts_service.schemas",
    ]


def test_the_core_importing_a_schema_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("from tts_service.schemas.jobs import JobConfig\n")
    monkeypatch.setitem(MODULES, "tts_service.runner_bad", bad)
    assert _violations("tts_service.runner_bad") == []  # not a core module: allowed
    monkeypatch.setitem(MODULES, "tts_service.drafters.bad", bad)
    assert _violations("tts_service.drafters.bad") == ["tts_service.schemas.jobs"]


def test_a_schema_importing_an_edge_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("import ray\nfrom tts_service.cli.common import UsageError\n")
    monkeypatch.setitem(MODULES, "tts_service.schemas.bad", bad)
    assert _violations("tts_service.schemas.bad") == ["ray", "tts_service.cli.common"]


def test_the_core_importing_a_tool_or_opening_a_store_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from tts_service.replay import LoggedOracle\n"
        "from store.memory import InMemoryNgramStore\n"
        "def f():\n    from store.factory import open_problem_store\n"
    )
    monkeypatch.setitem(MODULES, "tts_service.runner", bad)
    assert _violations("tts_service.runner") == [
        "store.factory",
        "store.memory",
        "tts_service.replay",
    ]
    monkeypatch.setitem(MODULES, "tts_service.replay", bad)  # a tool: in-process stores only
    assert _violations("tts_service.replay") == ["store.factory"]


def test_the_engine_importing_a_drafter_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tts_service.drafters.stand import StandDrafter\n")
    monkeypatch.setitem(MODULES, "tts_service.engine.bad", bad)
    assert _violations("tts_service.engine.bad") == ["tts_service.drafters.stand"]
