"""The house's size and shape, checked: no function over 60 lines, no file over 600 lines, no
compiled kernel taking more than 10 parameters, and no import circle between the project's
files (imports inside functions and under TYPE_CHECKING count: a circle there is still two files
that cannot be read apart).

`KNOWN` lists what still breaks the rules, each for a measured reason, and may only shrink: a
module on it must still break a rule, and nothing else may. Kernels take their arrays grouped
in plain tuples laid out by named tuples (numba's dispatcher types a named tuple field by field
in Python at every call) and unpack them once per call; a kernel that runs per tree node takes
its arrays one by one instead, since unpacking a tuple there counts a reference to each array
(`stand_kernel._candidates`: the draft kernel ran 1.3-1.6x slower with its tuples)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_layering import MODULES

MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600
MAX_KERNEL_PARAMETERS = 10
KNOWN = {
    "tts_service.drafters.stand_kernel": ["kernel _candidates: 28 parameters"],
}  # fmt: skip
"""What each module still breaks (see the module docstring); nothing may be added."""


def _is_kernel(node: ast.FunctionDef) -> bool:
    """Compiled by numba: decorated with `njit` / `jit` (called or not)."""
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("njit", "jit"):
            return True
    return False


def size_violations(path: Path) -> list[str]:
    """Every way `path` is too big: the file, a function (decorators excluded), a kernel's
    parameter list."""
    source = path.read_text(encoding="utf-8")
    bad = []
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        bad.append(f"file: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
            bad.append(f"{node.name}: {length} lines")
        params = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
        if (
            isinstance(node, ast.FunctionDef)
            and _is_kernel(node)
            and params > MAX_KERNEL_PARAMETERS
        ):
            bad.append(f"kernel {node.name}: {params} parameters")
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_small(module):
    assert size_violations(MODULES[module]) == KNOWN.get(module, [])


def test_an_oversized_function_file_and_kernel_are_caught(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    params = ", ".join(f"a{i}" for i in range(11))
    src = f"from numba import njit\n\n\ndef long():\n{body}\n\n\n@njit(cache=True)\n"
    src += f"def kernel({params}):\n    return a0\n" + "\n" * 600
    path = tmp_path / "big.py"
    path.write_text(src)
    assert size_violations(path) == [
        f"file: {src.count(chr(10))} lines",
        "long: 61 lines",
        "kernel kernel: 11 parameters",
    ]


def _imported_modules(module: str, path: Path) -> set[str]:
    """The project modules `module` imports, anywhere in it (`from pkg import mod` names the
    module `pkg.mod`, not the package, when every name is a module; a relative import resolves
    against `module`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = {f"{base}.{a.name}" for a in node.names}
            modules = names & MODULES.keys()
            found |= modules if modules == names else modules | {base}
    return {m for m in found if m in MODULES and m != module}


def import_circles(modules: dict[str, Path]) -> list[list[str]]:
    """Sets of files that import one another, directly or round a loop (Tarjan's strongly
    connected components of more than one file)."""
    graph = {m: sorted(_imported_modules(m, p) & modules.keys()) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(circles)


def test_no_import_circle_between_files():
    assert import_circles(MODULES) == []


def test_an_import_circle_is_caught(tmp_path):
    a, b, c = (tmp_path / f"{n}.py" for n in "abc")
    a.write_text("from store import b\n")
    b.write_text("def f():\n    from store.c import g\n")
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import store.a\n")
    modules = {"store.a": a, "store.b": b, "store.c": c}
    original = dict(MODULES)
    try:
        MODULES.update(modules)
        assert import_circles(modules) == [["store.a", "store.b", "store.c"]]
    finally:
        MODULES.clear()
        MODULES.update(original)
