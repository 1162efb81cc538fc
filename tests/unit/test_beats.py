"""A supervisor says only what changed: a member sends its report (and writes its document) when
the report differs from the last one it sent, else a bare heartbeat; the head counts that a
sign of life, and rewrites its own document on a heartbeat only when reports were merged since
it last wrote it, or when the written one grows old (FRESH_EVERY: `orch status` takes a document
older than 15 s for a dead head's)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from orchestrator.agent import protocol as proto
from orchestrator.agent import server as S


class Link:
    """What a supervisor's connection is to it here: what it was sent, in order."""

    def __init__(self, role=None, host=None):
        self.sent: list[dict] = []
        self.closed = False
        self.last = time.time()
        self.authed, self.role, self.host = True, role, host

    def send(self, m):
        self.sent.append(m)

    def flush(self):
        pass

    def message(self, line, limit):   # the line is the message itself here (sealed on a real link)
        return json.loads(line)


def cfg(tmp_path: Path, role: str) -> dict:
    rundir = tmp_path / role
    rundir.mkdir(mode=0o700)
    ranks = [{"rank": r, "host": h, "device": 0, "pid": None, "state": "pending", "exit_code": None, "signal": None,
              "start": None, "end": None, "attempt": 0} for r, h in enumerate(("h1", "h2"))]
    return {"run_id": "r1", "host": "h1" if role == "head" else "h2", "role": role, "token": "ab" * 16,
            "rundir": str(rundir), "workdir": str(tmp_path), "log_link": str(tmp_path / "log_output"),
            "launcher": "ranktable", "ranks": [{"rank": 0 if role == "head" else 1, "device": 0}], "procs": [],
            "hosts": ["h1", "h2"], "all_ranks": ranks, "join_timeout": 60, "lost_after": 10}


@pytest.fixture
def signals_back():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE,
                                              signal.SIGCHLD)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def beat(sup):
    """One turn of the loop with a heartbeat due."""
    sup.last_beat = 0.0
    if sup.is_head:
        sup.head_tick(False)
    else:
        sup.member_tick(False)


def test_an_idle_member_sends_a_heartbeat_and_writes_nothing(tmp_path, signals_back):
    sup = S.Supervisor(cfg(tmp_path, "member"))
    sup.head_conn = link = Link()
    doc = Path(sup.rundir) / "state.json"
    beat(sup)
    assert [m["t"] for m in link.sent] == ["report"] and doc.exists()
    doc.unlink()
    beat(sup)
    beat(sup)
    assert [m["t"] for m in link.sent] == ["report", "hb", "hb"]
    assert not doc.exists()                   # nothing changed: no document written
    sup.local.load.sample = {"t": 1.0, "procs": 1, "cpu": 5.0}   # a new load sample: the report differs
    beat(sup)
    assert link.sent[-1]["t"] == "report" and link.sent[-1]["report"]["load"]["cpu"] == 5.0
    assert json.loads(doc.read_text())["load"]["cpu"] == 5.0   # written with it
    sup.member_state = "lost"                 # its own state is part of what it says: in its document too
    beat(sup)
    assert link.sent[-1]["t"] == "report" and json.loads(doc.read_text())["state"] == "lost"
    sup.last_beat = S.now()                   # no heartbeat due: a change goes out at once all the same
    sup.local.stopping = ["a test", S.now() + 5, False]
    sup.member_tick(True)
    assert link.sent[-1]["t"] == "report" and link.sent[-1]["report"]["stopping"] == "a test"
    sup.member_tick(False)
    assert len(link.sent) == 6                # and nothing more before the next heartbeat


def test_the_head_takes_a_heartbeat_as_a_sign_of_life_and_rewrites_its_document_only_when_it_changed(
        tmp_path, signals_back):
    sup = S.Supervisor(cfg(tmp_path, "head"))
    doc = Path(sup.rundir) / "state.json"
    beat(sup)                                 # its own first report: merged, written
    h2 = sup.head.hosts["h2"]   # not joined: the run does not start here
    merged = sup.head.merged
    doc.unlink()
    h2.last = 0.0
    member = Link("member", "h2")
    sup.on_line(member, json.dumps(proto.heartbeat()).encode())
    beat(sup)
    assert h2.last > 0.0                      # heard: not silent
    assert sup.head.merged == merged          # nothing merged ...
    assert not doc.exists()                   # ... nothing written
    sup.on_line(member, json.dumps(proto.report(
        {"host": "h2", "attempt": 0, "ranks": [], "procs": [], "out": 0.0, "stopping": None, "live": False,
         "progress": [], "load": {"t": 1.0, "procs": 0, "cpu": 7.0}})).encode())
    beat(sup)
    assert sup.head.merged == merged + 1
    assert json.loads(doc.read_text())["load"]["h2"]["cpu"] == 7.0   # its figures written with the beat
    doc.unlink()
    beat(sup)
    assert not doc.exists()
    sup.saved_at -= S.FRESH_EVERY             # the written one grew old: a fresh one, changed or not
    beat(sup)
    assert doc.exists() and json.loads(doc.read_text())["updated"] > time.time() - 60
    doc.unlink()
    sup.head.doc["message"] = "a change held back"   # decide's publish, due after PUBLISH_GAP ...
    sup.publish_due = time.monotonic() + 60
    beat(sup)                                 # ... goes out with the heartbeat's, written too
    assert json.loads(doc.read_text())["message"] == "a change held back" and sup.publish_due is None


def test_a_member_may_send_the_head_a_heartbeat():
    assert proto.parse(proto.TO_HEAD["member"], proto.heartbeat()) == ("hb", {})
    with pytest.raises(proto.ProtocolError):
        proto.parse(proto.TO_HEAD["watcher"], proto.heartbeat())


def test_a_members_end_takes_the_stops_look_at_the_runs_processes(tmp_path, signals_back, monkeypatch):
    """A look for the run's processes reads every process's environment (procs.run_pids): in the
    turn a member ends, its stop's look answers both whether it may end and its last report's
    left_nothing (it read them three times)."""
    from orchestrator.agent import procs

    sup = S.Supervisor(cfg(tmp_path, "member"))
    sup.head_conn = link = Link()
    found = [[4242], [4242], []]   # the stop's TERM, then a look in each turn
    looks = []
    monkeypatch.setattr(procs, "run_pids", lambda run_id, me=None: looks.append(1) or (found.pop(0) if found else []))
    monkeypatch.setattr(procs, "signal_pids", lambda pids, sig: None)
    sup.on_head_message(proto.exit_("succeeded"))     # the run ended: the stop TERMs what is left
    assert sup.exiting and len(looks) == 1

    looks.clear()
    sup.tick(False)                                   # the loop's turn: something of the run still lives
    assert len(looks) == 1 and not sup.done
    sup.tick(False)
    assert len(looks) == 2 and sup.done                # one look a turn
    assert link.sent[-1]["t"] == "report" and link.sent[-1]["report"]["left_nothing"] is True


def running_member(tmp_path, ranks=(1, 2, 3)):
    sup = S.Supervisor(cfg(tmp_path, "member"))
    sup.head_conn = link = Link()
    sup.local.ranks = {r: {"rank": r, "host": "h2", "device": r, "pid": 100 + r, "state": "running", "exit_code": None,
                           "signal": None, "start": 1.0, "end": None, "attempt": 1} for r in ranks}
    beat(sup)
    assert [m["t"] for m in link.sent] == ["report"]
    return sup, link


def ended(sup, rank, code=0, sig=None):
    sup.local.ranks[rank].update(state="exited" if code == 0 and not sig else "failed", exit_code=code, signal=sig,
                                 end=S.now())


def states(m):
    return [r["state"] for r in m["report"]["ranks"]]


def test_a_members_reports_of_ranks_that_ended_well_are_gathered_while_others_run(tmp_path, signals_back):
    sup, link = running_member(tmp_path)
    ended(sup, 1)
    sup.member_tick(True)                     # the first good end: held back, END_GATHER at most
    assert len(link.sent) == 1 and sup.gather_until is not None
    assert sup.wait() <= S.END_GATHER         # the loop wakes for it
    ended(sup, 2)
    sup.member_tick(True)
    assert len(link.sent) == 1                # gathered with the first
    sup.local.grew = True                     # output growing (TICK turns): the gathered ends' time all the same
    assert sup.wait() <= S.END_GATHER
    sup.gather_until = time.monotonic() - 0.001   # its time is up: both ends in one report
    sup.member_tick(False)
    assert [m["t"] for m in link.sent] == ["report", "report"] and states(link.sent[-1]) == ["exited", "exited", "running"]
    assert sup.gather_until is None
    ended(sup, 3)                             # the last rank here: at once
    sup.member_tick(True)
    assert len(link.sent) == 3 and states(link.sent[-1]) == ["exited"] * 3


@pytest.mark.parametrize("how", ["failed", "signal", "stopping", "load"])
def test_anything_but_a_good_end_goes_out_at_once_with_what_was_gathered(tmp_path, signals_back, how):
    sup, link = running_member(tmp_path)
    ended(sup, 1)
    sup.member_tick(True)
    assert len(link.sent) == 1
    if how == "failed":
        ended(sup, 2, code=1)
    elif how == "signal":
        ended(sup, 2, code=None, sig=9)
    elif how == "stopping":
        sup.local.stopping = ["a test", S.now() + 5, False]
    else:
        sup.local.load.sample = {"t": 1.0, "procs": 1, "cpu": 5.0}
    sup.member_tick(True)
    assert len(link.sent) == 2 and link.sent[-1]["report"]["ranks"][0]["state"] == "exited"
    assert sup.gather_until is None


def test_good_ends_only_tells_a_good_end_from_anything_else():
    run = {"rank": 1, "state": "running", "exit_code": None, "signal": None, "end": None, "pid": 7}
    proc = {"key": "rank.1", "rank": 1, "pid": 7, "exit_code": None, "signal": None, "end": None}
    other = dict(run, rank=2)

    def rep(r, p, **kw):
        return ("running", {"ranks": [r, other], "procs": [p], "out": 1.0, "progress": [], "stopping": None,
                            "load": None, **kw})

    before = rep(run, proc)
    good = rep(dict(run, state="exited", exit_code=0, end=2.0), dict(proc, exit_code=0, end=2.0), out=2.0)
    assert S.good_ends_only(before, good)
    assert not S.good_ends_only(None, good)
    assert not S.good_ends_only(("stopped", before[1]), good)
    assert not S.good_ends_only(before, rep(dict(run, state="failed", exit_code=1, end=2.0), dict(proc, exit_code=1, end=2.0)))
    assert not S.good_ends_only(before, rep(dict(run, state="exited", exit_code=0, end=2.0, pid=8), proc))
    assert not S.good_ends_only(before, rep(dict(run, state="exited", exit_code=0, end=2.0), proc, load={"cpu": 1}))
    assert not S.good_ends_only(before, rep(run, proc, out=2.0, progress=[{"rank": 1}]))   # output alone: at once
    alone = ("running", {**before[1], "ranks": [run]})
    assert not S.good_ends_only(alone, ("running", {**good[1], "ranks": [good[1]["ranks"][0]]}))   # the last one
