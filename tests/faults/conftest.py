"""Fixtures for the fault suite: `fx_lab` (the shared lab fixtures are in tests/conftest.py).

`fx_lab("a", 3, refuse_key=[2])` makes a lab named ``fxa<pid base 36>`` (at most 8
characters, never clashing with other engineers' labs), torn down at the end of the
session. Like every lab test, these skip only where this machine cannot make a lab,
and fail instead when ``CI`` is set.
"""

from __future__ import annotations

import os

import pytest



def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


@pytest.fixture(scope="session")
def fx_lab(lab_factory):
    """Make labs named fx<letter><pid>: ``fx_lab("n", 3)`` -> a running Lab, made once per name
    and torn down by `lab_factory` at the end of the session."""
    made = {}

    def make(letter: str, n: int, vary=None, refuse_key=(), **topology):
        name = f"fx{letter}{_b36(os.getpid())}"[:8]
        spec = (n, tuple(vary or ()), tuple(refuse_key), tuple(sorted(topology.items())))
        if name not in made:
            made[name] = (spec, lab_factory(letter, n, vary=vary, refuse_key=refuse_key, name=name, **topology))
        if made[name][0] != spec:  # two modules asked for different labs under one letter
            raise AssertionError(f"fx_lab({letter!r}) is already a lab of {made[name][0]}, not {spec}: "
                                 "pick another letter")
        return made[name][1]

    return make
