"""fan_out over forked processes (shards.py): every host's outcome back, in order, whichever process
ran it; errors keep their type; a process that dies loses no host; the gate holds the forks back."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from orchestrator.errors import AuthError, HostError, RemoteTimeout, UsageError
from orchestrator import shards
from orchestrator.fanout import fan_out
from orchestrator.shards import ENV, decode_error, encode_error, fan_out_procs, procs_for
from orchestrator.spec import Host


def hosts(n):
    return [Host(name=f"h{i}", address=f"10.9.0.{i}", user="u") for i in range(n)]


def within(seconds, call):
    """call() in a thread: a fan-out that never returns fails the test instead of hanging it
    (what it raises is raised here)."""
    box = []

    def run():
        try:
            box.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised again below
            box.append((False, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"no result within {seconds}s"
    ok, value = box[0]
    if not ok:
        raise value
    return value


def sharded(hs, fn, procs=3, **kw):
    seen = []
    res = within(30, lambda: fan_out_procs(
        hs, fn, procs=procs, encode=lambda v: v, decode=lambda h, v: v, limit=8, timeout=20,
        on_done=lambda o: seen.append((o.host.name, threading.get_ident())), **kw))
    return res, seen


def test_every_shard_merged_in_host_order():
    me = os.getpid()
    res, seen = sharded(hosts(10), lambda h: {"name": h.name, "pid": os.getpid()})
    assert list(res) == [f"h{i}" for i in range(10)]
    assert all(o.ok and o.value["name"] == n for n, o in res.items())
    pids = {o.value["pid"] for o in res.values()}
    assert len(pids) == 3 and me in pids  # this process took its share, two forks theirs
    assert sorted(n for n, _ in seen) == sorted(res)  # on_done once per host ...
    assert len({t for _, t in seen}) == 1  # ... in the caller's thread only


def test_errors_keep_type_message_and_hint():
    def fn(h):
        if h.name == "h4":
            raise AuthError(h.name, "key refused", hint="run ssh-copy-id")
        if h.name == "h5":
            raise RuntimeError("a bug")
        return 1

    res, _ = sharded(hosts(6), fn)
    err = res["h4"].error
    assert type(err) is AuthError and err.host == "h4" and err.message == "h4: key refused"
    assert str(err) == str(AuthError("h4", "key refused", hint="run ssh-copy-id"))
    assert isinstance(res["h5"].error, HostError) and "RuntimeError: a bug" in str(res["h5"].error)
    assert res.succeeded == {f"h{i}": 1 for i in (0, 1, 2, 3)}


def test_error_round_trip_without_a_host():
    err = decode_error(encode_error(UsageError("bad", hint="fix it")))
    assert type(err) is UsageError and str(err) == "bad\n  hint: fix it"


def test_a_shard_that_dies_is_reported_per_host():
    me = os.getpid()

    def fn(h):
        if os.getpid() != me and h.name == "h1":  # the first fork (h1, h4, h7) dies at its first host
            os._exit(3)
        return h.name

    res, seen = sharded(hosts(9), fn)
    assert list(res) == [f"h{i}" for i in range(9)] and len(seen) == 9
    lost = {n for n, o in res.items() if not o.ok}
    assert lost == {"h1", "h4", "h7"}
    for n in lost:
        msg = str(res[n].error)
        assert isinstance(res[n].error, HostError) and msg.startswith(f"{n}: the worker process ")
        assert "exit code 3" in msg
    assert res.succeeded == {n: n for n in res if n not in lost}


def test_a_stuck_shard_is_stopped_at_its_deadline():
    me = os.getpid()

    def fn(h):
        if os.getpid() != me:
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process hangs: its own timeouts never fire
        return h.name

    res = within(20, lambda: fan_out_procs(hosts(4), fn, procs=2, encode=lambda v: v, decode=lambda h, v: v,
                                           limit=4, timeout=0.5))
    assert res.succeeded == {"h0": "h0", "h2": "h2"}
    assert set(res.failed) == {"h1", "h3"}
    assert all("went past its deadline and was stopped" in str(e) for e in res.failed.values())


def test_keep_and_gate(tmp_path):
    me = os.getpid()
    gate = threading.Event()
    opened = []
    marker = tmp_path / "gate-opened"

    def own(h):
        time.sleep(0.3)
        opened.append(h.name)
        marker.touch()
        gate.set()
        return os.getpid()

    def child(h):  # the kept host's probe (here: `own`) has run by now: the gate was set after it
        return [os.getpid(), marker.exists()]

    res = fan_out_procs(hosts(6), own, procs=2, encode=lambda v: v, decode=lambda h, v: v, limit=6,
                        timeout=20, keep={"h3"}, gate=gate, gate_timeout=5, child_fn=child)
    assert res["h3"].value == me  # kept here; round robin over the rest: h0 h2 h5 here, h1 h4 there
    assert [res[n].value for n in ("h0", "h2", "h5")] == [me] * 3
    forked = [res[n].value for n in ("h1", "h4")]
    assert all(pid != me for pid, _ in forked)
    assert all(seen for _, seen in forked) and opened  # not before the gate opened


def test_one_process_is_plain_fan_out():
    res = fan_out_procs(hosts(3), lambda h: os.getpid(), procs=1, encode=lambda v: v, decode=lambda h, v: v)
    assert set(res.succeeded.values()) == {os.getpid()}
    assert list(res) == list(fan_out(hosts(3), lambda h: 0))


def test_procs_for(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert procs_for(64) == 1 and procs_for(128) == 1
    cores = len(os.sched_getaffinity(0))
    assert procs_for(256) == min(2, cores) and procs_for(1000) == min(8, cores)
    monkeypatch.setenv(ENV, "3")
    assert procs_for(10) == 3
    monkeypatch.setenv(ENV, "x")
    with pytest.raises(UsageError):
        procs_for(10)


def test_timeouts_in_a_fork_stay_remote_timeouts():
    me = os.getpid()
    res = fan_out_procs(hosts(2), lambda h: time.sleep(2 if os.getpid() != me else 0), procs=2,
                        encode=lambda v: v, decode=lambda h, v: v, limit=2, timeout=0.3)
    assert isinstance(res["h1"].error, RemoteTimeout)


def test_child_exit_runs_in_each_fork_after_its_hosts(tmp_path):
    me = os.getpid()

    def bye():
        (tmp_path / f"closed-{os.getpid()}").write_text("")

    res = within(30, lambda: fan_out_procs(hosts(6), lambda h: os.getpid(), procs=3, encode=lambda v: v,
                                           decode=lambda h, v: v, limit=6, timeout=20, child_exit=bye))
    forks = {v for v in res.succeeded.values() if v != me}
    deadline = time.monotonic() + 10
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(forks) == 2 and {p.name for p in tmp_path.iterdir()} == {f"closed-{pid}" for pid in forks}


def test_a_failure_of_this_process_share_is_raised_not_waited_for(monkeypatch):
    """This process's own share failing as a whole (not a host's error: fan_out itself) is raised
    by fan_out_procs, the forks stopped; it used to leave the loop waiting for ever."""
    real = shards.fan_out
    me = os.getpid()

    def broken(hosts, fn, **kw):
        if os.getpid() == me:
            raise RuntimeError("the own share broke")
        return real(hosts, fn, **kw)

    monkeypatch.setattr(shards, "fan_out", broken)
    with pytest.raises(RuntimeError, match="own share broke"):
        within(20, lambda: fan_out_procs(hosts(4), lambda h: h.name, procs=2, encode=lambda v: v,
                                         decode=lambda h, v: v, limit=4, timeout=5))


def test_an_error_type_with_more_state_comes_back_as_its_base():
    """SpecError keeps its problems (its own __init__): decoded it is an OrchError with the same
    message, never a SpecError without `.problems`."""
    from orchestrator.errors import Location, OrchError, SpecError

    err = decode_error(encode_error(SpecError([(Location("c.yaml", 3), "bad")])))
    assert type(err) is OrchError and "c.yaml" in err.message
    auth = decode_error(encode_error(AuthError("h1", "key refused", hint="ssh-copy-id")))
    assert type(auth) is AuthError and auth.host == "h1" and auth.hint == "ssh-copy-id"
