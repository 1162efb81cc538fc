"""The supervisor's loop waits for what happens instead of turning 10 times a second: a signal (a
child's end), a wrapped rank's start or end (`agent.py rank` writes a byte into the run
directory's FIFO) or a message wake it; idle, it turns once a heartbeat."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from orchestrator.agent import layout, rank
from orchestrator.agent import server as S


@pytest.fixture
def member(tmp_path):
    """A member's supervisor (not joined to any head), its wake-ups open; signals put back after."""
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    cfg = {"run_id": "r1", "host": "h2", "role": "member", "token": "ab" * 16, "rundir": str(rundir),
           "workdir": str(tmp_path), "log_link": str(tmp_path / "log_output"), "launcher": "mpirun",
           "ranks": [{"rank": 0, "device": 0}], "procs": [], "hosts": ["h1", "h2"]}
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE,
                                              signal.SIGCHLD)}
    sup = S.Supervisor(cfg)
    sup.install_signals()
    sup.open_wake()
    try:
        yield sup
    finally:
        sup.close_wake()
        for s, h in saved.items():
            signal.signal(s, h)


def test_a_wrapped_ranks_word_wakes_the_loop_at_once(member):
    """rank.wake (the wrapper, once it wrote a rank's pid or end) makes io() return woken, long
    before its time-out; the FIFO is the user's alone and gone when the supervisor ends."""
    fifo = os.path.join(member.rundir, layout.WAKE)
    st = os.lstat(fifo)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077 == 0
    assert member.io(0) is False
    rank.wake(member.rundir)
    assert member.io(30) is True
    assert member.io(0) is False          # drained: one word, one wake-up
    member.close_wake()
    assert not os.path.exists(fifo)
    rank.wake(member.rundir)              # no supervisor: the wrapper neither fails nor waits


def test_a_childs_end_wakes_the_loop(member):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.returncode = 0   # reaped by Local, as the supervisor's children are
    assert member.io(30) is True
    member.local.reap()


def test_idle_the_loop_turns_once_a_heartbeat_busy_ten_times_a_second(member, monkeypatch):
    t = 1000.0
    monkeypatch.setattr(S, "now", lambda: t)   # the loop's clock held still: no machine is too slow for this
    member.last_beat = t
    assert member.wait() == min(S.IDLE_TICK, S.HEARTBEAT) and member.wait() > S.TICK
    member.last_beat = t - 5 * S.HEARTBEAT   # a heartbeat overdue: at once
    assert member.wait() == 0.0
    member.last_beat = t
    member.local.grew = True                       # output growing: progress read each TICK
    assert member.wait() == S.TICK
    member.local.grew = False
    member.local.stop("a test", 5)                 # a stop under way: TERM, then KILL on time
    assert member.wait() == S.TICK
