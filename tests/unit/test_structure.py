"""The package's structure rules (issue: code structure, round two), read from its source:

- no import cycle between its modules, counting the imports inside functions too (a cycle hidden
  by a function-level import is still one: the two modules cannot be understood apart);
- an import inside a function is there for start-up time (or for the hosts' stdlib-only agent),
  and says so: a `# lazy: <reason>` comment on its line or on the line above. The command modules
  (cli.py, cli_lab.py, api.py) load each command's modules when that command runs, which their
  docstrings say once; they need no comment per import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

PKG = REPO / "orchestrator"
COMMAND_MODULES = {"cli.py", "cli_lab.py", "api.py", "__init__.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    pkg = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
    where = ".".join(base + ([node.module] if node.module else []))
    out = []
    for a in node.names:
        full = f"{where}.{a.name}"
        out.append(full if full in MODULES else where)
    return [t for t in out if t in MODULES and t != module]


def _imports(module: str) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """(import statement, inside a function?) of a module; `if TYPE_CHECKING:` blocks left out."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, inside))
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(MODULES[module].read_text()), False)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = {m: {t for node, _ in _imports(m) for t in _targets(m, node)} for m in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_inside_a_function_says_why():
    missing = []
    for m, path in MODULES.items():
        if path.name in COMMAND_MODULES and path.parent == PKG:
            continue
        lines = path.read_text().splitlines()
        for node, inside in _imports(m):
            if not inside or not _targets(m, node):
                continue
            here, above = lines[node.lineno - 1], lines[node.lineno - 2].strip()
            if "# lazy:" not in here and not above.startswith("# lazy:"):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {here.strip()}")
    assert not missing, "imports inside functions without `# lazy: <reason>`:\n" + "\n".join(missing)
