"""The agent's stand-ins for standard modules it no longer imports at a supervisor's start (enum,
signal, socket, selectors, base64, re: ~8 ms of CPU on every host's start, test_agent_package
holds the imports): each does what the module did, for what the agent asks of it."""

from __future__ import annotations

import base64
import binascii
import enum
import os
import pickle
import re
import selectors
import signal
import socket

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.agent import metrics, protocol, server, states
from orchestrator.agent.states import RankState, RunState


# --------------------------------------------------------------------------- states: enum's part

class EnumRun(str, enum.Enum):   # what RunState was: the reference
    STARTING = "starting"
    RUNNING = "running"


def test_a_state_is_its_string_as_the_enum_member_was():
    assert not isinstance(RunState.RUNNING, enum.Enum)   # the stand-in, not enum (which is not imported)
    assert RunState.RUNNING == "running" and EnumRun.RUNNING == "running"
    assert isinstance(RunState.RUNNING, RunState) and isinstance(RunState.RUNNING, str)
    assert RunState("running") is RunState.RUNNING
    assert RunState(RunState.LOST) is RunState.LOST
    assert str(RunState.LOST) == "lost" and f"{RunState.LOST}" == "lost" and "%s" % RunState.LOST == "lost"
    assert RunState.LOST.value == "lost" and RunState.LOST.name == "LOST"
    assert repr(RunState.LOST) == "<RunState.LOST: 'lost'>"
    assert repr(EnumRun.RUNNING) == "<EnumRun.RUNNING: 'running'>"
    assert pickle.loads(pickle.dumps(RankState.EXITED)) is RankState.EXITED
    assert [s.value for s in RunState][:3] == ["starting", "running", "succeeded"] and len(RunState) == 10
    assert {RunState.LOST: 1}["lost"] == 1   # hashes as its string (JSON documents' keys and values)


@pytest.mark.parametrize("bad", ["RUNNING", "", "runnin", None, 3, b"running", RankState.EXITED])
def test_anything_but_a_states_string_is_a_value_error_as_with_enum(bad):
    with pytest.raises(ValueError):
        RunState(bad)
    with pytest.raises(ValueError):
        EnumRun(bad)


def test_a_state_word_is_not_another_kind_of_state():
    assert RankState("running") is RankState.RUNNING and RunState("running") is RunState.RUNNING
    assert not isinstance(RankState.RUNNING, RunState)
    assert RankState.RUNNING.ended is False and RankState.LOST.ended is True
    assert RunState.SUCCEEDED.is_terminal and not RunState.RUNNING.is_terminal


@pytest.mark.parametrize("sig", range(0, 70))
def test_a_signal_is_named_as_signal_signals_names_it(sig):
    try:
        want = signal.Signals(sig).name
    except ValueError:
        want = None
    assert states.signal_name(sig) == want
    assert states.describe(None, sig) == (f"killed by signal {sig} ({want or f'signal {sig}'})" if sig else
                                          "no exit code (killed or lost)")


# --------------------------------------------------------------------------- protocol: base64's part

B64_TEXT = st.one_of(st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
                     st.text(alphabet="ABCab019+/=-_ \n\x00é!", max_size=24), st.binary(max_size=24))


def same_outcome(got, want, text):
    try:
        w = want(text)
    except ValueError:
        with pytest.raises(ValueError):
            got(text)
    else:
        assert got(text) == w


@settings(max_examples=400)
@given(B64_TEXT)
def test_b64decode_decodes_and_refuses_what_base64_validate_does(text):
    same_outcome(protocol.b64decode, lambda t: base64.b64decode(t, validate=True), text)


class NoStrictMode:
    """binascii before 3.11: a2b_base64 has no strict_mode."""
    Error = binascii.Error

    @staticmethod
    def a2b_base64(data, **kw):
        if kw:
            raise TypeError("a2b_base64() takes no keyword arguments")
        return binascii.a2b_base64(data)


def base64_before_3_11(text):   # base64.b64decode(text, validate=True) of Python 3.8-3.10
    data = text.encode("ascii") if isinstance(text, str) else text
    if not re.fullmatch(b"[A-Za-z0-9+/]*={0,2}", data):
        raise binascii.Error("Non-base64 digit found")
    return binascii.a2b_base64(data)


@settings(max_examples=400)
@given(B64_TEXT)
def test_b64decode_without_strict_mode_does_what_base64_did_before_3_11(text):
    real = protocol.binascii
    protocol.binascii = NoStrictMode   # hypothesis runs the examples in this thread: no other user
    try:
        same_outcome(protocol.b64decode, base64_before_3_11, text)
    finally:
        protocol.binascii = real


def test_packed_files_are_still_base64_of_zlib():
    files = {"rank_table.json": "{}\n" * 100, "hostfile": "a slots=2\n"}
    packed = protocol.pack_files(files)
    assert base64.b64decode(packed, validate=True)
    assert protocol.unpack_files(packed) == files
    with pytest.raises(protocol.ProtocolError):
        protocol.unpack_files(packed[:-4] + "!!!!")
    with pytest.raises(binascii.Error):
        protocol.b64decode("QQ===")


# --------------------------------------------------------------------------- metrics: re's part

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}\Z")


@settings(max_examples=400)
@given(st.one_of(st.text(max_size=70), st.text(alphabet="aZ_09.-é\n ", max_size=70)))
def test_a_metric_name_is_checked_as_the_regular_expression_did(name):
    assert metrics.name_ok(name) == bool(NAME.match(name))


PIECES = [b"epoch:", b"epoch: 1", b" step: 20", b", step: 3", b"step:", b" loss is ", b"loss is 2.30", b"0.5", b",",
          b" ", b"\n", b"Tensor(shape=[], dtype=Float32, value= 1.5)", b"epoch time: 12.5 ms, per step time: 1.2 ms",
          b"Train epoch time:", b"{'loss': 0.69, 'epoch': 0.5}", b"{'eval_loss': 1e-3}", b"{'", b"'loss': 1", b"}",
          b"EPOCH: 1", b"rank 0 device 0"]


def progress_of(text: bytes, needles: bool):
    builtin = metrics.BUILTIN if needles else tuple((n, b"", p) for n, _, p in metrics.BUILTIN)
    real, metrics.BUILTIN = metrics.BUILTIN, builtin   # b"" is in every chunk: every pattern searched
    try:
        p = metrics.Progress()
        p.reset([0])
        r = p.ranks[0]
        p.feed(r, text + b"\n", 1.0)
        return r.record(1.0)
    finally:
        metrics.BUILTIN = real


@settings(max_examples=300)
@given(st.lists(st.sampled_from(PIECES), max_size=12).map(b"".join))
def test_skipping_a_chunk_without_a_needle_reads_the_same_progress_as_searching_it(text):
    # each needle is a literal every match of its pattern contains (not in an optional part)
    assert progress_of(text, needles=True) == progress_of(text, needles=False)


@pytest.mark.parametrize("line", [b"epoch: 1 step: 20 loss is 2.30", b"epoch: 1, step: 20, loss is 2.30",
                                  b"epoch: 2 step: 20, loss is Tensor(shape=[], dtype=Float32, value= 2.30)"])
def test_a_mindspore_line_with_or_without_commas_is_read(line):
    assert progress_of(line, needles=True)["step"] == 20 and progress_of(line, needles=True)["loss"] == 2.3


# --------------------------------------------------------------------------- server: selectors' and socket's part

def test_the_poller_registers_selects_and_unregisters_as_a_selector_does():
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    p, ref = server.Poller(), selectors.DefaultSelector()
    try:
        for sel in (p, ref):
            args = (a, "A") if sel is p else (a, selectors.EVENT_READ, "A")
            sel.register(*args)
            with pytest.raises(KeyError):
                sel.register(*args)
        p.register(c.fileno(), "C")
        assert p.select(0) == []
        b.send(b"x")
        d.send(b"y")
        got = sorted((k.data, k.fd, k.fileobj is a) for k, _ in p.select(1))
        assert got == [("A", a.fileno(), True), ("C", c.fileno(), False)]
        assert [k.data for k, _ in ref.select(1)] == ["A"]
        assert p.unregister(a).data == "A"
        with pytest.raises(KeyError):
            p.unregister(a)
        assert [k.data for k, _ in p.select(None)] == ["C"]   # no limit: c is ready
        p.register(a, "A2")
        a.close()   # closed while registered: still found by the object, as selectors finds it
        assert p.unregister(a).data == "A2"
        with pytest.raises(ValueError):
            p.register(a, "closed")
    finally:
        p.close()
        ref.close()
        for s in (a, b, c, d):
            s.close()


def test_connect_and_accept_work_on_the_c_modules_sockets():
    lst, port, advertised = server.listen(["127.0.0.1"], True)
    try:
        assert advertised == ["127.0.0.1"]
        with pytest.raises(BlockingIOError):
            server.accept(lst[0])
        c = server.connect("127.0.0.1", port, 5)
        s, addr = server.accept(lst[0])
        try:
            assert addr[0] == "127.0.0.1" and c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert not os.get_inheritable(s.fileno()) and s.family == socket.AF_INET
            c.sendall(b"hello\n")
            s.settimeout(5)
            assert s.recv(16) == b"hello\n"
        finally:
            c.close()
            s.close()
        for x in lst:
            x.close()
        with pytest.raises(OSError):   # nothing listens there now
            server.connect("127.0.0.1", port, 5)
    finally:
        for x in lst:
            x.close()


@pytest.mark.parametrize("address, family", [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6),
                                             ("198.18.0.1", socket.AF_INET)])
def test_an_address_is_connected_to_as_it_is(address, family):
    assert server.addresses_of(address, 7) == [(family, (address, 7) if family == socket.AF_INET else
                                                 (address, 7, 0, 0))]


def test_a_name_goes_through_getaddrinfo():
    got = server.addresses_of("localhost", 7)
    assert got and all(sa[1] == 7 for _, sa in got)
    with pytest.raises(OSError):
        server.addresses_of("no-such-host.invalid", 7)


def test_a_port_taken_on_another_address_is_not_the_heads():
    """The port the kernel gives 127.0.0.1 may be in use on the host's other address (a connection
    of its own from that address): the head listens on another one, on every address, rather than
    failing to start ("cannot listen on ..., nor on any other address")."""
    taken = socket.socket()
    taken.bind(("127.0.0.2", 0))   # all of 127/8 is this host's: "another address" of it
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        lst, got, advertised = server.listen(["127.0.0.2"], True, first_port=port)
        try:
            assert got != port and advertised == ["127.0.0.2"]
            assert sorted(s.getsockname()[0] for s in lst) == ["127.0.0.1", "127.0.0.2"]
        finally:
            for s in lst:
                s.close()
    finally:
        taken.close()
