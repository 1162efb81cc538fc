"""Sessions on one host's connection (SshTransport._session): sshd frees a session's place a
moment after it ends, so where it takes one at a time (MaxSessions 1) a session asked for in
that moment is refused; such a refusal is asked again, any other is said at once. The transport's
clock is a fake one here (Clock): what it waits is read, never timed. (The lab's side:
tests/faults/test_lifecycle.py, a host with MaxSessions 1.)"""

from __future__ import annotations

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


class Clock:
    """ssh's `time` here: it moves only when the transport sleeps."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture(autouse=True)
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(ssh, "time", c)
    return c


class Server:
    """A connection whose server refuses the sessions asked for while `refusing()` says so;
    `asked`: the clock's time of each ask."""

    def __init__(self, refusing):
        self.refusing, self.asked = refusing, []

    def is_active(self) -> bool:
        return True

    def open_session(self, timeout=None) -> Chan:
        self.asked.append(ssh.time.monotonic())
        if self.refusing():
            raise paramiko.ChannelException(2, "Connect failed")
        return Chan()


def transport(server: Server) -> ssh.SshTransport:
    t = ssh.SshTransport(Host(name="h1", address="198.18.0.1", user="u"))
    t._transport = server   # connect() keeps a connection that is active
    return t


def test_a_session_refused_just_after_one_of_ours_ended_is_asked_again_and_runs(clock):
    refusals = iter([False, True, True, True])   # the first session runs; the next, 3 times refused
    server = Server(lambda: next(refusals, False))
    t = transport(server)
    assert t.run("true").ok
    assert t.run("true").ok
    assert len(server.asked) == 5 and clock.slept == [0.01, 0.02, 0.04]


def test_a_refusal_with_no_session_ended_lately_is_said_at_once(clock):
    server = Server(lambda: True)
    t = transport(server)
    with pytest.raises(SessionRefused, match="MaxSessions"):
        t.run("true")
    assert len(server.asked) == 1 and clock.slept == []


def test_refused_until_linger_is_over_is_said_and_the_connection_stays(clock):
    refusing = [False]
    server = Server(lambda: refusing[0])
    t = transport(server)
    assert t.run("true").ok
    refusing[0] = True   # the server does not free the place in time
    ended = t._ended
    with pytest.raises(SessionRefused):
        t.run("true")
    # spaced out, doubling to 0.2 s apart; the last ask as LINGER ends
    assert clock.slept[:5] == [0.01, 0.02, 0.04, 0.08, 0.16] and max(clock.slept) == 0.2
    assert server.asked[-1] == pytest.approx(ended + ssh.LINGER) and len(server.asked) == 1 + 1 + len(clock.slept)
    assert t._transport is server   # the connection works: it stays, for the sessions it has
    refusing[0] = False
    assert t.run("true").ok


def test_a_refusal_while_ours_fill_the_places_the_server_gave_is_said_at_once(clock):
    """A session of ours open (the server has never had two at once: MaxSessions 1, say), one
    just ended: the one place is ours, not lingering. Said at once, for the caller to decide
    (lifecycle.start waits for the sync that has it)."""
    server = Server(lambda: len(server.asked) > 2)
    t = transport(server)
    assert t.run("true").ok
    t._session(server, 1)   # a start waiting beside the sync, say
    with pytest.raises(SessionRefused):
        t.run("true")
    assert len(server.asked) == 3 and clock.slept == []


def test_a_refusal_below_the_most_the_server_had_open_at_once_is_asked_again(clock):
    """Two of ours were open at once (MaxSessions 2, say); one of them just ended and the other
    is open: the next is refused until sshd frees the place, then runs."""
    refusals = iter([False, False, True, True])
    server = Server(lambda: next(refusals, False))
    t = transport(server)
    t._session(server, 1)
    t._close(t._session(server, 1))
    assert t.run("true").ok
    assert len(server.asked) == 5 and clock.slept == [0.01, 0.02]


def test_a_refusal_while_a_session_is_held_lets_the_held_one_go_first(clock):
    """The held session is let go (MaxSessions 1), then sshd's moment before it frees its place
    is waited out."""
    held: list[Chan] = []
    refused_after_close = iter([True])
    server = Server(lambda: held != [] and (not held[0].closed or next(refused_after_close, False)))
    t = transport(server)
    held.append(t._session(server, 1))
    t._held = held[0]
    assert t.run("true").ok
    assert held[0].closed and t._held is None and len(server.asked) == 4 and clock.slept == [0.01]
