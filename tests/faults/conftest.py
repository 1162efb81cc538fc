"""Fixtures for the fault suite: `fx_lab` (the shared lab fixtures are in tests/conftest.py).

`fx_lab("a", 3, refuse_key=[2])` makes a lab named ``fxa<pid base 36>`` (at most 8
characters, never clashing with other engineers' labs), torn down at the end of the
session. Like every lab test, these skip only where this machine cannot make a lab,
and fail instead when ``CI`` is set.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import _require_lab


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


@pytest.fixture(scope="session")
def fx_lab():
    """Make labs named fx<letter><pid>: ``fx_lab("n", 3)`` -> a running Lab."""
    _require_lab()
    from orchestrator.lab import Lab

    made: dict[str, Lab] = {}

    def make(letter: str, n: int, vary=None, refuse_key=()) -> Lab:
        name = f"fx{letter}{_b36(os.getpid())}"[:8]
        if name in made:
            return made[name]
        lab_ = Lab(name)
        made[name] = lab_
        return lab_.up(n, vary=vary, refuse_key=refuse_key)

    yield make
    errors = []
    for lab_ in reversed(list(made.values())):
        try:
            lab_.down()
        except Exception as exc:  # noqa: BLE001 - tear down every lab, report all failures
            errors.append(f"{lab_.name}: {exc}")
    if errors:
        pytest.fail("lab teardown failed: " + "; ".join(errors))
