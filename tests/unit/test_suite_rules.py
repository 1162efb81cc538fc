"""Rules the test suites hold themselves to, checked on their source."""

from __future__ import annotations

import ast
from pathlib import Path

FAULTS = Path(__file__).resolve().parent.parent / "faults"
WORDS = {"err", "out", "msg", "message", "stderr", "stdout", "table", "text"}


def _reads_words(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in WORDS or isinstance(n, ast.Attribute) and n.attr in WORDS:
            return True
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "message":
            return True
    return False


def _expects_failure(fn: ast.FunctionDef) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "orch" and any(
        kw.arg == "check_rc" and isinstance(kw.value, ast.Constant) and kw.value.value not in (0, None)
        for kw in n.keywords) for n in ast.walk(fn))


def test_every_fault_test_that_expects_a_failure_asserts_its_words():
    """A message that names a cause must come from the evidence, so a fault test that expects
    orch to fail asserts what orch said (its output or the run's message), not only the exit
    code."""
    bare = []
    for path in sorted(FAULTS.glob("test_*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and _expects_failure(fn):
                if not any(isinstance(n, ast.Assert) and _reads_words(n.test) for n in ast.walk(fn)):
                    bare.append(f"{path.name}:{fn.lineno} {fn.name}")
    assert bare == [], "fault tests asserting an exit code but no words:\n" + "\n".join(bare)
