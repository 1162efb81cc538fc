"""Sessions on one host's connection (SshTransport._session): sshd frees a session's place a
moment after it ends, so where it takes one at a time (MaxSessions 1) a session asked for in
that moment is refused; such a refusal is asked again, any other is said at once. (The lab's
side: tests/faults/test_lifecycle.py, a host with MaxSessions 1.)"""

from __future__ import annotations

import time

import paramiko
import pytest

from orchestrator.errors import SessionRefused
from orchestrator.model import Host
from orchestrator.transport import ssh


class Chan:
    """A session whose command ends at once, exit status 0, having said nothing."""

    closed = False
    eof_received = True

    def exec_command(self, command: str) -> None:
        self.command = command

    def sendall(self, data: bytes) -> None:
        pass

    def shutdown_write(self) -> None:
        pass

    def settimeout(self, t) -> None:
        pass

    def recv_ready(self) -> bool:
        return False

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return True

    def recv_exit_status(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class Server:
    """A connection whose server refuses the sessions asked for while `refusing()` says so."""

    def __init__(self, refusing):
        self.refusing, self.asked = refusing, []

    def is_active(self) -> bool:
        return True

    def open_session(self, timeout=None) -> Chan:
        self.asked.append(time.monotonic())
        if self.refusing():
            raise paramiko.ChannelException(2, "Connect failed")
        return Chan()


def transport(server: Server) -> ssh.SshTransport:
    t = ssh.SshTransport(Host(name="h1", address="198.18.0.1", user="u"))
    t._transport = server   # connect() keeps a connection that is active
    return t


def test_a_session_refused_just_after_one_of_ours_ended_is_asked_again_and_runs():
    refusals = iter([False, True, True, True])   # the first session runs; the next, 3 times refused
    server = Server(lambda: next(refusals, False))
    t = transport(server)
    assert t.run("true").ok
    assert t.run("true").ok
    assert len(server.asked) == 5
    assert server.asked[-1] - server.asked[1] < ssh.LINGER


def test_a_refusal_with_no_session_ended_lately_is_said_at_once():
    server = Server(lambda: True)
    t = transport(server)
    began = time.monotonic()
    with pytest.raises(SessionRefused, match="MaxSessions"):
        t.run("true")
    assert len(server.asked) == 1 and time.monotonic() - began < ssh.LINGER / 2


def test_refused_for_longer_than_linger_after_an_end_is_said_and_the_connection_stays():
    refusing = [False]
    server = Server(lambda: refusing[0])
    t = transport(server)
    assert t.run("true").ok
    refusing[0] = True   # another session of ours holds the one place meanwhile
    ended = server.asked[0]
    with pytest.raises(SessionRefused):
        t.run("true")
    asked = server.asked[1:]
    assert asked[-1] - ended <= ssh.LINGER and 3 <= len(asked) <= 20   # spaced out, up to 0.2 s apart
    assert t._transport is server   # the connection works: it stays, for the sessions it has
    refusing[0] = False
    assert t.run("true").ok


def test_a_refusal_while_a_session_is_held_lets_the_held_one_go_first():
    server = Server(lambda: held.closed is False)
    held = Chan()
    t = transport(server)
    t._held = held
    assert t.run("true").ok
    assert held.closed and t._held is None and len(server.asked) == 2
