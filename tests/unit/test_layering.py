"""The layering rules, checked for every module (imports inside functions included).

Data flows one way: edge (CLI, jobs, Serve) -> actors -> runner -> engine -> store. The core
(engine, drafters, aggregate, config, the runner and its glue) never imports Ray, Redis, HTTP,
the actors or an edge; the store never imports the service; an edge never imports another
edge (the CLI is the launcher: it may start Serve and submit jobs)."""

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
    "tts_service.solve",
    "tts_service.calibrate",
    "tts_service.replay",
)
CORE_STORE = ("store.base", "store.memory", "store.config")  # in-process parts only


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
    assert all(any(_within(m, (p,)) for m in MODULES) for p in CORE + EDGES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_respects_the_layering(module):
    assert _violations(module) == []


def test_a_violation_is_caught(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import ray\n    from actors.pool import GeneratorPool\n")
    monkeypatch.setitem(MODULES, "tts_service.engine.bad", bad)
    assert _violations("tts_service.engine.bad") == ["actors.pool", "ray"]
