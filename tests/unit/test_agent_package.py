"""The hosts' supervisor (orchestrator/agent) runs on any host's python3 >= 3.8 with the
standard library alone, and imports its own modules relatively (it is `orch_agent` there)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from orchestrator import supervisor

SOURCES = supervisor.agent_sources()


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_python_3_8_syntax_standard_library_only_relative_imports(name):
    tree = ast.parse(SOURCES[name], filename=name, feature_version=(3, 8))
    in_annotations = {id(n) for a in _annotations(tree) for n in ast.walk(a)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in sys.stdlib_module_names, (name, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module.split(".")[0] in sys.stdlib_module_names, (name, node.module)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and id(node) not in in_annotations:
            # builtin generics (list[int]) at run time are 3.9+
            assert node.value.id not in ("list", "dict", "tuple", "set", "frozenset", "type"), (name, node.lineno)
    # annotations (for mypy: states, protocol and head are checked strictly) only where python never
    # evaluates them: `int | None` and `list[str]` are 3.10/3.9 at run time (ruff's FA rules too)
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                    and any(a.name == "annotations" for a in n.names) for n in tree.body)
    for a in _annotations(tree):
        assert postponed, (name, a.lineno, "an annotation in the agent needs `from __future__ import annotations`")


def _annotations(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            yield from (x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                        if x is not None and x.annotation is not None)
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def test_the_package_is_every_module_of_orchestrator_agent():
    here = Path(supervisor.__file__).resolve().parent.parent / "agent"
    assert set(SOURCES) == {p.name for p in here.glob("*.py")}
    assert {"__init__.py", "cli.py", "head.py", "layout.py", "procs.py", "protocol.py", "server.py",
            "states.py"} <= set(SOURCES)
