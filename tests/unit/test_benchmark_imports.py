"""The benchmarks (tests/benchmarks/, run by hand and by run_all.py, never by the suite) import
orch's modules, in their own code and in the driver programs they hand to a python3 as strings:
every such import must name what exists. One of them named a module renamed long before, and
the benchmark failed at its first step without anyone seeing it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _imports(tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of every import of orchestrator in `tree`."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "orchestrator":
            out += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "orchestrator"]
    return out


def _programs(tree: ast.AST) -> list[ast.AST]:
    """The string constants that are python programs importing orchestrator (the drivers)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "orchestrator" in node.value \
                and ("import " in node.value) and "\n" in node.value:
            try:
                out.append(ast.parse(node.value))
            except SyntaxError:
                continue   # a shell script or a message, not a program
    return out


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_every_orchestrator_import_of_a_benchmark_names_what_exists(path):
    tree = ast.parse(path.read_text(), str(path))
    found = _imports(tree) + [i for prog in _programs(tree) for i in _imports(prog)]
    for module, name, line in found:
        try:
            mod = importlib.import_module(module)
            if name is not None and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")   # a submodule; raises if there is none
        except ImportError as exc:
            pytest.fail(f"{path.name}:{line}: {exc}")
