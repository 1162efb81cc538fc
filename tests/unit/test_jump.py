"""Jump-host connections (transport/ssh.py), with a fake paramiko transport: what fails for one
host behind a jump host must not take the shared connection down for the others."""

from __future__ import annotations

import time

import paramiko
import pytest

from orchestrator.errors import AuthError, ConnectError, TransientNetworkError
from orchestrator.spec import Host, SshSettings
from orchestrator.transport.ssh import Gateways, SshTransport, _Tunnel


class FakeTransport:
    def __init__(self, fail: Exception):
        self.active, self.fail, self.closed = True, fail, False

    def is_active(self):
        return self.active

    def open_channel(self, *a, **kw):
        raise self.fail

    def close(self):
        self.closed = True


def _hop(fail: Exception, monkeypatch) -> SshTransport:
    """A jump host's transport over a fake connection; it never opens a real one."""
    t = SshTransport(Host(name="bastion", address="192.0.2.1", user="u"))
    t._transport = FakeTransport(fail)
    t._client = type("C", (), {"close": lambda self: None})()
    monkeypatch.setattr(t, "connect", lambda: None)
    return t


def test_a_slow_target_does_not_close_the_shared_connection(monkeypatch):
    hop = _hop(paramiko.SSHException("Timeout opening channel."), monkeypatch)
    with pytest.raises(TransientNetworkError, match="could not reach 10.0.0.9:22"):
        hop.open_tunnel("10.0.0.9", 22, 1.0)
    assert hop._transport is not None and not hop._transport.closed  # still there for the others
    fake = hop._transport
    fake.active = False  # the connection itself is gone: then it is closed
    with pytest.raises(TransientNetworkError, match="lost the SSH connection"):
        hop.open_tunnel("10.0.0.9", 22, 1.0)
    assert hop._transport is None


def test_a_jump_hosts_failure_answers_for_a_while_a_refusal_for_good(monkeypatch):
    g = Gateways(SshSettings(connect_timeout=1, retries=1))
    chain = (Host(name="b", address="192.0.2.1", user="u"),)
    hop, slots = g.hop(chain)
    assert g.hop(chain)[0] is hop and hop.failure_memory == 1
    calls = []

    def down(attempts):
        calls.append(1)
        raise TransientNetworkError("b", "connection refused")  # (no network: _connect is replaced)
    monkeypatch.setattr(hop, "_connect", down)
    for _ in range(3):
        with pytest.raises(ConnectError):
            hop.connect()
    assert len(calls) == 1  # every host behind it got the same answer
    hop._failed = (time.monotonic() - 2, hop._failed[1])  # later: tried again
    with pytest.raises(ConnectError):
        hop.connect()
    assert len(calls) == 2

    def refused(attempts):
        calls.append(1)
        raise AuthError("b", "key refused")
    monkeypatch.setattr(hop, "_connect", refused)
    hop._failed = None
    for _ in range(2):
        with pytest.raises(AuthError):
            hop.connect()
    assert len(calls) == 3


def test_hosts_with_other_keys_get_their_own_jump_connection_and_outer_hops_close_last():
    g = Gateways(SshSettings())
    a = Host(name="b", address="192.0.2.1", user="u", identity_file="/k1")
    b = Host(name="b", address="192.0.2.1", user="u", identity_file="/k2")
    inner = Host(name="i", address="10.0.0.1", user="u")
    assert g.hop((a,))[0] is not g.hop((b,))[0]
    order = []
    for chain in ((a,), (a, inner)):
        t = g.hop(chain)[0]
        t.close = (lambda name: lambda: order.append(name))(len(chain))
    g.close()  # (nothing was connected: closing touches no network)
    assert order == [2, 1]


def test_tunnel_send_and_close_never_run_at_once():
    """A close from another thread waits for a send under way (no sleeps deciding the order:
    the send blocks until the test lets it go)."""
    import threading

    events, sending, release = [], threading.Event(), threading.Event()

    class Chan:
        def send(self, data):
            events.append("send-start")
            sending.set()
            release.wait(10)
            events.append("send-end")
            return len(data)

        def close(self):
            events.append("close")

    t = _Tunnel(Chan())
    sender = threading.Thread(target=t.send, args=(b"x",))
    sender.start()
    assert sending.wait(10)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and events == ["send-start"]  # the close is held while the send is on
    release.set()
    sender.join(10)
    closer.join(10)
    assert events == ["send-start", "send-end", "close"]


def test_a_caller_that_retries_itself_gets_one_bounded_connect(monkeypatch):
    """Following a run, the controller's own loop is the retry: `run(..., connect_attempts=1)`
    makes one connect try (one connect_timeout), not ssh.retries of them; other calls keep them."""
    t = SshTransport(Host(name="h", address="192.0.2.1", user="u"), connect_timeout=1, retries=3)
    tries = []

    def unreachable(timeout):
        tries.append(timeout)
        raise TransientNetworkError("h", "cannot connect to 192.0.2.1:22: No route to host")
    monkeypatch.setattr(t, "_open", unreachable)
    monkeypatch.setattr("tenacity.nap.time.sleep", lambda s: None)
    with pytest.raises(TransientNetworkError, match="No route to host"):
        t.run(["true"], connect_attempts=1)
    assert len(tries) == 1
    with pytest.raises(TransientNetworkError):
        t.run(["true"])
    assert len(tries) == 1 + 3
