"""The agent's JSON (orch_agent/jsonc.py: CPython's C scanner and encoder, no json package): the
same text as json.dumps and the same values (or a ValueError) as json.loads, for any value and
any text; json itself where the C functions are not there."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import supervisor
from orchestrator.agent import jsonc

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
                      max_leaves=30)


def _same(a, b) -> bool:
    """Equal, NaN included (NaN != NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_the_c_functions_are_used_here():
    assert jsonc._C is not None


@settings(max_examples=300)
@given(VALUES)
def test_dumps_is_json_dumps_and_loads_reads_it_back(value):
    for sep in (None, (",", ":")):
        text = jsonc.dumps(value, sep)
        assert text == json.dumps(value, separators=sep)
        assert _same(jsonc.loads(text), json.loads(text))
        assert _same(jsonc.loads(text.encode()), json.loads(text))


def _outcome(fn, text):
    try:
        return "ok", fn(text)
    except ValueError:
        return "ValueError", None


@settings(max_examples=500)
@given(st.text(alphabet=st.sampled_from(list(' \t\n\r{}[],:"\\01.e-+truefalsnNIiyx\ufeff\x01\u00e9')), max_size=30))
def test_loads_takes_and_refuses_what_json_loads_does(text):
    got, want = _outcome(jsonc.loads, text), _outcome(json.loads, text)
    assert got[0] == want[0], text
    assert _same(got[1], want[1])


def test_what_json_has_no_form_for_and_a_circular_value_are_refused_as_json_refuses_them():
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonc.dumps({"a": object()})
    d: dict = {}
    d["me"] = d
    with pytest.raises(ValueError, match="Circular"):
        jsonc.dumps(d)
    d.clear()   # and the next value is not taken for circular
    assert jsonc.dumps({"me": [1]}) == '{"me": [1]}'


def test_deep_nesting_is_a_recursion_error_as_with_json():
    with pytest.raises(RecursionError):
        jsonc.loads("[" * 100_000 + "]" * 100_000)


def test_without_the_c_functions_json_does_the_work(monkeypatch):
    monkeypatch.setitem(sys.modules, "_json", None)
    try:
        m = importlib.reload(jsonc)
        assert m._C is None
        assert m.dumps({"a": [1, 2.5]}, (",", ":")) == '{"a":[1,2.5]}'
        assert m.loads(b' {"a": [1, 2.5]} ') == {"a": [1, 2.5]}
        with pytest.raises(ValueError):
            m.loads("[1,]")
    finally:
        monkeypatch.undo()
        importlib.reload(jsonc)
    assert jsonc._C is not None


def test_the_module_imports_neither_json_nor_re(tmp_path):
    """As on a host: the package alone (orch_agent), python3 -S."""
    pkg = tmp_path / "orch_agent"
    pkg.mkdir()
    for name, text in supervisor.agent_sources().items():
        (pkg / name).write_text(text)
    code = (f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom orch_agent import jsonc\n"
            "print(jsonc._C is not None, 'json' in sys.modules, 're' in sys.modules)")
    got = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", "False", "False"]
