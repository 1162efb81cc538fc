"""README's "What orch promises", the part that holds without a lab: one test (or a few) per
promise, each through a stable entry point (the CLI through click's runner, spec.load_cluster,
hostsets, the agent package, the transport) so it outlives code moving between modules.

Each test here was seen failing on a deliberately broken copy of the code (the 4 MB limit set to
1 TB, the expansion limit removed, exit codes above 128 called signals, ...); the promises that
need real hosts are held by tests/faults (README names them)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import cli as climod
from orchestrator.errors import SpecError
from orchestrator.spec import load_cluster

LOCAL = "inventory:\n  hosts: [{address: 'n[1-2]', connection: local, slots: 2}]\n"
JOB = "job: {workdir: /data/j, command: 'python x.py'}\n"


def orch(*args: str):
    """`orch ARGS` in this process (click's runner): (exit code, everything it printed)."""
    res = CliRunner().invoke(climod.cli, list(args))
    return res.exit_code, res.output


def cluster_file(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, newline="")
    return p


def refused(tmp_path: Path, text: str, line: int | None) -> str:
    """`orch plan` of a cluster file that must be refused: exit 2, one located error, no
    traceback. Returns the output."""
    f = cluster_file(tmp_path, text)
    rc, out = orch("plan", str(f))
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert f"{f}:{line}:" in out if line is not None else f"{f}:" in out, out
    return out


# --------------------------------------------------------------------------- Bounded input
# Cluster files over 4 MB, YAML alias bombs (over 200k values), NUL bytes, control characters and
# `slots` above 1024 are exit 2 with file and line, at once.

def test_a_cluster_file_over_4_mb_is_refused_unread(tmp_path):
    text = LOCAL + JOB
    text += "#" * ((4 << 20) + 1 - len(text))  # one byte over
    out = refused(tmp_path, text, None)
    assert "orch reads at most 4 MB" in out, out


def _values(n: int) -> str:
    """A file whose YAML holds about n values, through aliases (`&a [x, x, ...]`, `*a` repeated)."""
    per = 1000
    return ("x: &a [" + ", ".join(["v"] * per) + "]\n"
            "y: [" + ", ".join(["*a"] * (n // per)) + "]\n")


def test_an_alias_bomb_over_200k_values_is_refused_with_its_line(tmp_path):
    out = refused(tmp_path, _values(201_000) + LOCAL + JOB, 1)  # the aliased values
    assert "expands to more than 200000 values" in out, out


def test_200k_values_less_a_little_are_read(tmp_path):
    with pytest.raises(SpecError) as exc:  # read whole: only what the file means is wrong
        load_cluster(cluster_file(tmp_path, _values(190_000) + LOCAL + JOB))
    assert "unknown key 'x'" in str(exc.value)


@pytest.mark.parametrize("text, line, needle", [
    (LOCAL + JOB + "\0\n", 4, "a NUL byte"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\\0b\"}\n", 3, "a NUL character"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x01b\"}\n", 3, "YAML error"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x1bb\"}\n", 3, "YAML error"),
])
def test_nul_bytes_and_control_characters_are_refused_with_their_line(tmp_path, text, line, needle):
    out = refused(tmp_path, text, line)
    assert needle in out, out


def test_slots_above_1024_are_refused_with_their_line(tmp_path):
    text = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1025}\n" + JOB
    out = refused(tmp_path, text, 3)
    assert "more than 1024 ranks on one host" in out, out
    ok = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1024}\n" + JOB
    assert load_cluster(cluster_file(tmp_path, ok)).hosts[0].slots == 1024
