"""The held session's pieces that need no host (the lab's side: tests/integration/test_held.py):
the command's encoding, the exit status line, the probe's shape when it holds."""

from __future__ import annotations

import subprocess

import pytest

from orchestrator import probes
from orchestrator.checks import reach
from orchestrator.transport.base import PROBE_END, held_go
from orchestrator.transport.ssh import _held_status


def test_a_go_is_its_length_then_the_variables_and_the_arguments_nul_separated():
    assert held_go({"A": "1", "B": "x y"}, ["prog", "", "é"]) == \
        b"go 20\n" + b"2\0A\x001\0B\0x y\0prog\0\0" + "é".encode()
    with pytest.raises(ValueError):
        held_go({"A": "a\0b"}, ["prog"])
    with pytest.raises(ValueError):
        held_go({}, ["x" * (1 << 20)])


@pytest.mark.parametrize("out, want", [
    (b"ok 1 2 -\n\n@@orch:exit 0\n", (0, b"ok 1 2 -\n")),
    (b"\n@@orch:exit 3\n", (3, b"")),
    (b"no newline\n@@orch:exit 12\n", (12, b"no newline")),
    (b"said @@orch:exit 3 in a line\n\n@@orch:exit 1\n", (1, b"said @@orch:exit 3 in a line\n")),
])
def test_the_commands_exit_status_is_its_last_line(out, want):
    assert _held_status(out) == want


def test_no_exit_status_line_is_255_and_says_so():
    rc, out = _held_status(b"ok 1 2 -\n")
    assert rc == 255 and out.startswith(b"ok 1 2 -\n") and b"without the command's exit status" in out


def test_a_holding_probe_gives_the_session_to_its_section_alone_and_ends_with_probe_end():
    fds = "sh -c 'for i in 3 4 5 7; do [ -e /proc/self/fd/$i ] && echo has $i; done; true'"
    script = probes.assemble("h", [("clock0", "date")], [("mesh", fds)], [("user", fds)], [("clock1", "date")],
                             hold="reach", lead=[("reach", fds), ("other", fds)], given=("user",))
    lines = script.splitlines()
    assert lines[1:4] == ["exec 3<&0 5>&2 6>&1", "{", "exec 7>&1 1>&6 4>&6 6>&-"]
    assert lines[-2:] == [f"printf '%s\\n' '{PROBE_END.decode().strip()}'", "} | cat"]
    assert script.index("exec 3<&- 4>&- 5>&- 7>&-") < script.index("_b user")   # the sh's user: reach gave none
    # the lead section that holds has them; no other section
    out = subprocess.run(["sh", "-c", script], stdin=subprocess.PIPE, capture_output=True, timeout=30).stdout
    got = probes.split_sections(out.decode())
    assert got["reach"].body == "has 3\nhas 4\nhas 5\nhas 7\n"
    assert got["other"].body == got["user"].body == got["mesh"].body == "", out
    assert out.endswith(PROBE_END)
    plain = probes.assemble("h", [("clock0", "date")], [("mesh", "ssh y")], [("user", "id -un")], [("clock1", "date")],
                            lead=[("reach", "python3 x")])
    assert "3<&" not in plain and "4>&" not in plain and "| cat" not in plain and "probe-end" not in plain


def test_held_reads_the_reach_sections_own_line():
    sec = probes.split_sections("@@orch:begin reach\nto a ok\norch:list 0\nheld\n\n@@orch:end reach 0\n")
    assert reach.held(sec)
    assert not reach.held(probes.split_sections("@@orch:begin reach\nto a ok\nthe held line\n\n@@orch:end reach 0\n"))
    assert not reach.held(None) and not reach.held({})
