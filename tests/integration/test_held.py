"""A session held past its script (transport.probe(hold=True), checks/reach.py HOLD_PY): the
process the script left waits for one command and runs it as `python3 -S -c` would; `orch up`
starts each member's supervisor so (no SSH session, no python3 start of its own). On a real sshd
(a lab host): sshd closes a session's stdin once its shell ends, which is what the probe's
`{ ...; } | cat` is for."""

from __future__ import annotations

import os
import shlex
import socket
import time
import uuid

import pytest

from orchestrator import probes
from orchestrator.checks import reach
from orchestrator.spec import SshSettings
from orchestrator.transport import make_transport

from tests.support import lab_cluster

# what the started program prints: its argv, an env value, its stdin, the dispositions of
# SIGINT and SIGQUIT (SigIgn), then it exits with the code given
PROGRAM = ("import os,sys\nsys.stdout.write(repr(sys.argv[1:])+'|'+os.environ.get('X','-')+'|'+sys.stdin.read())\n"
           "sys.stdout.write('|tag=%s' % os.environ.get('ORCH_TAG', '-'))\nsys.stderr.write('to stderr \\udcff\\n')\n"
           "ign=int([l for l in open('/proc/self/status') if l.startswith('SigIgn')][0].split()[1],16)\n"
           "sys.stdout.write('|int-quit-ignored=%d' % (ign & 0b110))\n"
           "code=sys.argv[-1]\nsys.exit(int(code) if code.isdigit() else code)\n")


class _Stdin:
    def __init__(self, data: bytes):
        self.data = data

    def read(self, n: int = -1, /) -> bytes:
        out, self.data = (self.data, b"") if n < 0 else (self.data[:n], self.data[n:])
        return out


@pytest.fixture
def host(lab, tmp_path):
    t = make_transport(lab_cluster(lab, tmp_path).hosts[1], SshSettings(connect_timeout=5, command_timeout=30, retries=2))
    yield t
    t.close()


def held_probe(tag: str, hold: float) -> str:
    """A probe holding its session as up's does: the reach section's python3 with HOLD_PY (and
    a section after it that lingers, as any other section may)."""
    body = (f"ORCH_TAG={tag} {reach.HOLD_ENV}='{hold:g} ORCH_TAG' "
            f"python3 -S -c {shlex.quote('import os,sys' + chr(10) + reach.HOLD_PY)} 2>&1")
    return probes.assemble("h", [], [], [("other", "echo other")], [], hold=reach.SECTION, lead=[(reach.SECTION, body)])


def tagged(tag: str) -> list[str]:
    """Processes (on any lab host) whose environment carries ORCH_TAG=tag."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if f"ORCH_TAG={tag}".encode() in fh.read().split(b"\0"):
                    out.append(pid)
        except OSError:
            pass
    return out


def gone(tag: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while tagged(tag):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_held_session_runs_one_command_with_its_env_argv_stdin_and_exit_status(host):
    tag = uuid.uuid4().hex
    r = host.probe(held_probe(tag, 30), hold=True)
    secs = probes.split_sections(r.out)
    assert reach.held(secs), r.out
    assert secs["other"].body.strip() == "other"
    assert tagged(tag), "nothing holds the session"
    got = host.start_held({"X": "it's $HOME"}, [PROGRAM, "a b", "", "3"], _Stdin(b"in\nput"))
    assert got is not None
    assert (got.exit_code, got.out) == (3, "['a b', '', '3']|it's $HOME|in\nput|tag=-|int-quit-ignored=0")
    assert got.err == "to stderr \\udcff\n"   # its own stream, as python3's stderr writes what it cannot encode
    assert gone(tag), "the held process outlived its command"


@pytest.mark.parametrize("last, code, said", [("'orch: no'", 1, "orch: no\n"), ("0", 0, "")])
def test_sys_exit_with_a_message_or_none_is_pythons_own(host, last, code, said):
    tag = uuid.uuid4().hex
    host.probe(held_probe(tag, 30), hold=True)
    got = host.start_held({}, ["import sys\nsys.exit(%s)" % last], _Stdin(b""))
    assert got is not None and (got.exit_code, got.out, got.err) == (code, "", said)


def test_a_command_that_raises_gives_its_traceback_and_status_1(host):
    host.probe(held_probe(uuid.uuid4().hex, 30), hold=True)
    got = host.start_held({}, ["raise RuntimeError('boom')"], _Stdin(b""))
    assert got is not None and got.exit_code == 1
    assert "RuntimeError: boom" in got.err and got.out == ""


def test_a_holder_that_gave_up_waiting_runs_nothing_and_says_so(host):
    tag = uuid.uuid4().hex
    host.probe(held_probe(tag, 1), hold=True)
    assert gone(tag), "the held process did not give up after its time"
    assert host.start_held({}, [PROGRAM, "0"], _Stdin(b"")) is None
    assert host.run("echo still").out == "still\n"   # the connection is fine


def test_released_the_holder_exits_and_nothing_more_is_held(host):
    tag = uuid.uuid4().hex
    host.probe(held_probe(tag, 60), hold=True)
    assert tagged(tag)
    host.release_held()
    assert gone(tag), "the held process outlived its session"
    assert host.start_held({}, [PROGRAM, "0"], _Stdin(b"")) is None


def test_a_holder_killed_before_the_command_runs_nothing(host):
    tag = uuid.uuid4().hex
    host.probe(held_probe(tag, 60), hold=True)
    for pid in tagged(tag):
        os.kill(int(pid), 9)
    assert gone(tag)
    assert host.start_held({}, [PROGRAM, "0"], _Stdin(b"")) is None


def test_a_connection_dropped_under_it_ends_the_holder(host):
    """`orch up` killed, or its network gone: no channel is closed, the TCP connection just ends;
    sshd ends the session and the holder, with it, its stdin."""
    tag = uuid.uuid4().hex
    host.probe(held_probe(tag, 60), hold=True)
    assert tagged(tag)
    host._transport.sock.shutdown(socket.SHUT_RDWR)   # not close(): what a killed process's kernel does
    assert gone(tag), "the held process outlived the connection"


def test_without_python3_nothing_is_held_and_the_probe_ends_as_ever(host):
    body = "if command -v no-such-python >/dev/null 2>&1; then no-such-python; else echo orch:not-installed; fi"
    r = host.probe(probes.assemble("h", [], [], [], [], hold=reach.SECTION, lead=[(reach.SECTION, body)]), hold=True)
    secs = probes.split_sections(r.out)
    assert not reach.held(secs) and "orch:not-installed" in secs[reach.SECTION].body
    host.release_held()
    assert host.start_held({}, [PROGRAM, "0"], _Stdin(b"")) is None
