"""The head's decisions: a pure state machine.

`decide(head, events, now) -> (head, actions)` makes every decision about a Head (the server
only adds a failed launcher's last words to the message it decided, and records a crash). It
does no I/O and reads no clock: everything it knows comes in as events (a host joined, a host's
report, a host gone, a stop asked for) and `now`; everything it wants done goes out as actions,
which the server carries out (server.py). So every duty is tested without a process
(tests/unit/test_head.py).

Phases: join -> run -> stopping -> (delay -> run ...) -> done.

Duties, checked in this order while an attempt runs, each a small function below:
    stop asked     -> the attempt ends `stopped`
    lost hosts     -> `lost`: a joined host whose supervisor disconnected or stayed silent
                      for lost_after seconds
    fail-fast      -> `failed`, naming the rank that ended FIRST (not the lowest), on any host;
                      with on_failure: continue, only once every rank has ended
    launchers      -> mpirun/msrun/torchrun that failed or ended with ranks unreported
    success        -> `succeeded`: every rank exited 0 (and every launcher ended)
    stall          -> `stalled`: no rank wrote a byte for stall_timeout seconds (stacks first)
    time-out       -> `timeout`: job.timeout seconds since the run started
An attempt that ends failed or stalled starts again after restart_delay while restarts remain.

Actions:
    ("start", attempt, head_address)   every host starts the attempt's processes
    ("stop", reason)                   every host stops them (TERM, KILL after the grace)
    ("dump",)                          every host captures its ranks' stacks
    ("exit", state)                    members: the run is over
    ("publish",)                       write state.json, tell the watchers
    ("done",)                          the head's work is over
"""

from enum import Enum

from .states import (ATTEMPT_TRANSITIONS, RANK_TRANSITIONS, RETRYABLE, RUN_TRANSITIONS, RankState, RunState,
                     allowed, check, describe, rank_ranges)
from . import load, metrics
from .protocol import STATE_VERSION

LAUNCHER_REPORT_GRACE = 5.0   # after a launcher ends, how long its ranks have to report
DONE_LINGER = 3.0             # after the end, how long the head waits for members to hear it


class Phase(str, Enum):
    JOIN = "join"
    RUN = "run"
    STOPPING = "stopping"
    DELAY = "delay"
    DONE = "done"


class HostView:
    __slots__ = ("joined", "connected", "last", "report", "address")

    def __init__(self, now):
        self.joined = False
        self.connected = False
        self.last = now
        self.report = None      # the last report of the current attempt
        self.address = None     # the head's address this host reached it on


class Head:
    """What the head knows of the run. `doc` is the run's document (state.json, watchers)."""

    def __init__(self, cfg, now):
        self.run_id = cfg["run_id"]
        self.me = cfg["host"]
        self.on_failure = cfg.get("on_failure", "stop")
        self.restarts = int(cfg.get("restarts") or 0)
        self.restart_delay = float(cfg.get("restart_delay") or 0)
        self.stall_timeout = float(cfg.get("stall_timeout") or 0)
        self.timeout = float(cfg.get("timeout") or 0)
        self.grace = float(cfg.get("grace", 5))
        self.lost_after = float(cfg.get("lost_after", 10))
        self.addresses = list(cfg.get("head_addresses") or [])
        self.hosts = {h: HostView(now) for h in cfg["hosts"]}
        self.hosts[self.me].joined = self.hosts[self.me].connected = True
        self.rank_host = {r["rank"]: r["host"] for r in cfg["all_ranks"]}
        self.doc = {"v": STATE_VERSION, "orch": cfg.get("orch_version"), "run": self.run_id,
                    "state": RunState.STARTING, "head": self.me, "attempt": 0, "attempts": [],
                    "ranks": [dict(r) for r in cfg["all_ranks"]], "lost": [], "message": "",
                    "first_failure": None, "started": now, "ended": None, "launcher": cfg.get("launcher"),
                    "restarts": self.restarts, "head_address": None, "reached": {}}
        self.phase = Phase.JOIN
        self.phase_until = now + float(cfg.get("join_timeout", 60))
        self.stop_request = None
        self.lost_why = {}            # host -> what was seen when it was counted lost
        self.outcome = None           # (state, message) of the attempt that is ending
        self.settle_until = 0.0
        self.stop_sent = False
        self.launcher_end = None
        self.attempt_started = now

    # ---- helpers
    @property
    def state(self):
        return self.doc["state"]

    def others(self):
        return [(n, h) for n, h in self.hosts.items() if n != self.me]

    def can_join(self, host):
        """A member may join once: a second join for a host (a replay, or someone posing as it) is refused."""
        h = self.hosts.get(host)
        return h is not None and host != self.me and not h.joined

    def _run_to(self, new):
        self.doc["state"] = check(RUN_TRANSITIONS, self.doc["state"], new, "run")

    def _rank_to(self, r, new):
        r["state"] = check(RANK_TRANSITIONS, RankState(r["state"]), new, "rank %d" % r["rank"])


# --------------------------------------------------------------------------- events

def joined(host, address):
    return ("joined", host, address)


def reported(host, report):
    return ("report", host, report)


def gone(host):
    return ("gone", host)


def stop_asked(reason):
    return ("stop", reason)


def _apply(head, ev, now):
    kind = ev[0]
    if kind == "joined":
        h = head.hosts[ev[1]]
        h.joined = h.connected = True
        h.last = now
        h.address = ev[2]
        head.doc["reached"][ev[1]] = ev[2]
        return True
    if kind == "gone":
        h = head.hosts.get(ev[1])
        if h is not None:
            h.connected = False
        return False
    if kind == "stop":
        if head.stop_request is None:
            head.stop_request = ev[1] or "a request"
        return False
    if kind == "report":
        host, rep = ev[1], ev[2]
        h = head.hosts.get(host)
        if h is None:
            return False
        h.last = now
        if rep.get("attempt") != head.doc["attempt"]:
            return False
        h.report = rep
        metrics.merge(head.doc, head.rank_host, host, rep.get("progress"))   # published with the next beat
        load.merge(head.doc, host, rep.get("load"))
        return _merge(head, host, rep)
    raise ValueError("unknown event %r" % (kind,))


def _merge(head, host, rep):
    """A host's report of its own ranks -> the run's rank records. Only that host's ranks, only
    ranks not ended yet (a late report never undoes or rewrites an end), and only transitions
    the table allows."""
    by_rank = {r["rank"]: r for r in head.doc["ranks"]}
    changed = False
    for x in rep["ranks"]:
        r = by_rank.get(x["rank"])
        if r is None or head.rank_host.get(x["rank"]) != host or x.get("attempt") != head.doc["attempt"]:
            continue
        old, new = RankState(r["state"]), RankState(x["state"])
        if r["end"] is not None or not allowed(RANK_TRANSITIONS, old, new):
            continue
        for k in ("pid", "state", "exit_code", "signal", "start", "end"):
            if r.get(k) != x.get(k):
                r[k] = x.get(k)
                changed = True
    return changed


# --------------------------------------------------------------------------- decide

def decide(head, events, now):
    """Apply the events, then take the phase's decisions. Returns (head, actions)."""
    actions = []
    changed = False
    for ev in events:
        changed = _apply(head, ev, now) or changed
    changed = _notice_lost(head, now) or changed
    step = _PHASES[head.phase]
    changed = step(head, now, actions) or changed
    if changed and not any(a[0] == "publish" for a in actions):
        actions.append(("publish",))
    return head, actions


def _notice_lost(head, now):
    """A joined member whose connection closed, or that stayed silent for lost_after seconds."""
    if head.phase == Phase.DONE:
        return False
    changed = False
    for name, h in head.others():
        if h.joined and name not in head.doc["lost"] and (not h.connected or now - h.last > head.lost_after):
            head.doc["lost"].append(name)
            # what was seen, no more: a closed connection, or silence (a cut link closes nothing)
            head.lost_why[name] = ("the connection to its supervisor closed" if not h.connected else
                                   "its supervisor was silent for %.1fs" % (now - h.last))
            changed = True
    return changed


def _phase_join(head, now, actions):
    missing = [n for n, h in head.hosts.items() if not h.joined]
    if head.stop_request:
        _finish(head, now, actions, RunState.STOPPED,
                "stopped by %s before the ranks started" % head.stop_request)
    elif head.doc["lost"]:
        _finish(head, now, actions, RunState.LOST, "the supervisor on %s disconnected before the ranks "
                "started; nothing was started" % ", ".join(head.doc["lost"]))
    elif not missing:
        _start_attempt(head, now, actions, 1)
    elif now > head.phase_until:
        head.doc["lost"] = missing
        _finish(head, now, actions, RunState.LOST, "the supervisor on %s never reached the launch host's "
                "(tried %s); nothing was started" % (", ".join(missing), ", ".join(head.addresses) or "?"))
    else:
        return False
    return True


def head_address(head):
    """The launch host's address as the other hosts reached it (most of them; ties: the
    preferred one), for torchrun's and msrun's master address and MASTER_ADDR."""
    counts = {}
    for _, h in head.others():
        if h.address:
            counts[h.address] = counts.get(h.address, 0) + 1
    if not counts:
        return head.addresses[0] if head.addresses else "127.0.0.1"
    order = {a: i for i, a in enumerate(head.addresses)}
    return sorted(counts, key=lambda a: (-counts[a], order.get(a, len(order)), a))[0]


def _start_attempt(head, now, actions, k):
    head.phase = Phase.RUN
    if head.doc["state"] == RunState.STARTING:
        head._run_to(RunState.RUNNING)
    head.doc.update(attempt=k, first_failure=None)
    head.doc["head_address"] = address = head_address(head)
    head.doc["attempts"].append({"attempt": k, "state": RunState.RUNNING, "start": now, "end": None,
                                 "message": "", "first_failure": None})
    for r in head.doc["ranks"]:
        r.update(state=RankState.PENDING, pid=None, exit_code=None, signal=None, start=None, end=None, attempt=k)
    for _, h in head.hosts.items():
        h.report = None
    head.launcher_end = None
    head.attempt_started = now
    actions.append(("start", k, address))
    actions.append(("publish",))


# ---- the duties of a running attempt

def _failures(head, now):
    """(when, rank record, how) of every failed rank, the first to end first."""
    out = [((r.get("end") or now), r, describe(r["exit_code"], r["signal"]))
           for r in head.doc["ranks"] if r["state"] == RankState.FAILED]
    return sorted(out, key=lambda f: (f[0], f[1]["rank"]))


def _name_first_failure(head, now):
    fails = _failures(head, now)
    if not fails:
        return None
    _, r, how = fails[0]
    head.doc["first_failure"] = {"rank": r["rank"], "host": r["host"], "device": r.get("device"),
                                 "exit_code": r["exit_code"], "signal": r["signal"], "how": how,
                                 "attempt": head.doc["attempt"]}
    return head.doc["first_failure"]


def _failure_message(ff):
    return "rank %d on %s (device %s) failed: %s" % (ff["rank"], ff["host"], ff["device"], ff["how"])


def _launchers(head):
    """{key: (host, proc record)} of every launcher process (mpirun, msrun, torchrun), every host."""
    out = {}
    for name, h in head.hosts.items():
        rep = h.report
        if rep is None or rep.get("attempt") != head.doc["attempt"]:
            continue
        for p in rep["procs"]:
            if p.get("rank") is None:
                out[p["key"]] = (name, p)
    return out


def duty_stop_asked(head, now):
    if head.stop_request:
        return RunState.STOPPED, "stopped by %s" % head.stop_request, 0.0
    return None


def duty_lost(head, now):
    lost = head.doc["lost"]
    if not lost:
        return None
    ranks = rank_ranges(r["rank"] for r in head.doc["ranks"] if r["host"] in lost)
    seen = "; ".join(("%s: " % n if len(lost) > 1 else "") + head.lost_why.get(n, "lost") for n in lost)
    return (RunState.LOST, "lost contact with host %s (%s): %s. The run was stopped on every other host; a "
            "supervisor that loses the launch host stops its own ranks. Once the host is reachable, `orch status "
            "--run %s` shows them and `orch down --run %s` cleans up" % (", ".join(lost), ranks, seen, head.run_id,
                                                                          head.run_id), 0.0)


def duty_fail_fast(head, now):
    ff = _name_first_failure(head, now)
    if ff is None:
        return None
    all_ended = all(r["end"] is not None for r in head.doc["ranks"])
    if head.on_failure == "stop" or all_ended:
        return RunState.FAILED, _failure_message(ff), 0.0
    return None


def duty_launchers(head, now):
    """A launcher (mpirun, msrun, torchrun) that failed, or ended with ranks that never said how
    they ended: its ranks report within moments (their wrapper writes before exiting), so wait
    LAUNCHER_REPORT_GRACE first."""
    launchers = _launchers(head)
    failed = [(k, h, p) for k, (h, p) in sorted(launchers.items())
              if p["end"] is not None and (p["exit_code"] != 0 or p["signal"])]
    ended = bool(launchers) and all(p["end"] is not None for _, p in launchers.values())
    if not (failed or ended):
        return None
    all_ended = all(r["end"] is not None for r in head.doc["ranks"])
    if head.launcher_end is None:
        head.launcher_end = now
    if not all_ended and now - head.launcher_end < LAUNCHER_REPORT_GRACE:
        return "wait"
    if failed and head.doc["first_failure"] is None:
        k, h, p = failed[0]
        return (RunState.FAILED, "%s on %s failed: %s" % (k.split(".")[0], h, describe(p["exit_code"], p["signal"])),
                0.0, (k, h))
    if not all_ended:
        missing = [r["rank"] for r in head.doc["ranks"] if r["end"] is None]
        return RunState.FAILED, "%s never reported an exit code" % rank_ranges(missing), 0.0
    return None


def duty_success(head, now):
    if head.doc["first_failure"] is not None:
        return None
    if not all(r["end"] is not None for r in head.doc["ranks"]):
        return None
    launchers = _launchers(head)
    if launchers and not all(p["end"] is not None for _, p in launchers.values()):
        return None
    return RunState.SUCCEEDED, "all %d ranks exited 0" % len(head.doc["ranks"]), 0.0


def duty_stall(head, now):
    if not head.stall_timeout:
        return None
    last = max([head.attempt_started] + [h.report["out"] for _, h in head.hosts.items()
                                         if h.report is not None])
    if now - last <= head.stall_timeout:
        return None
    return (RunState.STALLED, "no rank wrote any output for %gs: stacks captured (in each rank's log, or "
            "stacks.txt beside it with py-spy)" % head.stall_timeout, 2.0)


def duty_timeout(head, now):
    if head.timeout and now - head.doc["started"] > head.timeout:
        return (RunState.TIMEOUT, "the job did not finish within job.timeout = %gs (timed out)" % head.timeout, 0.0)
    return None


DUTIES = (duty_stop_asked, duty_lost, duty_fail_fast, duty_launchers, duty_success, duty_stall, duty_timeout)


def _phase_run(head, now, actions):
    for duty in DUTIES:
        verdict = duty(head, now)
        if verdict == "wait":
            return False
        if verdict is not None:
            state, message, settle = verdict[:3]
            if state == RunState.STALLED:
                actions.append(("dump",))
            if len(verdict) > 3:
                actions.append(("launcher_failed", verdict[3][0], verdict[3][1]))
            _end_attempt(head, now, actions, state, message, settle)
            _phase_stopping(head, now, actions)   # the stop goes out now unless it waits to settle
            return True
    return False


def _end_attempt(head, now, actions, outcome, message, settle=0.0):
    head.outcome = (outcome, message)
    att = head.doc["attempts"][-1]
    att["state"] = check(ATTEMPT_TRANSITIONS, RunState(att["state"]), outcome, "attempt")
    att.update(end=now, message=message, first_failure=head.doc["first_failure"])
    head.phase = Phase.STOPPING
    head.settle_until = now + settle
    head.phase_until = now + settle + head.grace + 5.0
    head.doc["message"] = message
    head.stop_sent = False
    actions.append(("publish",))


def _phase_stopping(head, now, actions):
    if not head.stop_sent:
        if now < head.settle_until:
            return False
        head.stop_sent = True
        actions.append(("stop", head.outcome[1]))
        return False
    remaining = [n for n, h in head.hosts.items() if n not in head.doc["lost"] and h.joined
                 and (h.report is None or h.report.get("live"))]
    if remaining and now <= head.phase_until:
        return False
    for r in head.doc["ranks"]:
        if r["end"] is None:
            head._rank_to(r, RankState.LOST if r["host"] in head.doc["lost"] else RankState.STOPPED)
            r["end"] = now
    outcome, message = head.outcome
    if outcome == RunState.FAILED and _failures(head, now):
        message = _settle_failures(head, now)   # every host has reported by now
        head.outcome = (outcome, message)
        head.doc["attempts"][-1].update(message=message, first_failure=head.doc["first_failure"])
    k = head.doc["attempt"]
    if outcome in RETRYABLE and k <= head.restarts and not head.stop_request and head.doc["lost"]:
        message = "%s; not restarted: lost contact with host %s" % (message, ", ".join(head.doc["lost"]))
    elif outcome in RETRYABLE and k <= head.restarts and not head.stop_request:
        head.phase = Phase.DELAY
        head.phase_until = now + head.restart_delay
        head.doc["message"] = "%s; restarting (attempt %d of %d)" % (message, k + 1, head.restarts + 1)
        actions.append(("publish",))
        return True
    _finish(head, now, actions, outcome, message)
    return True


def _settle_failures(head, now):
    """The failure named is the rank that ended first, on whichever host (the others most often
    died of it: mpirun and msrun kill a failed rank's siblings); ranks killed after it by a
    launcher's TERM/KILL count as stopped, not failed. Called only when a rank failed."""
    ff = _name_first_failure(head, now)
    first_end = _failures(head, now)[0][0]
    for r in head.doc["ranks"]:
        if (r["state"] == RankState.FAILED and r["rank"] != ff["rank"] and r["signal"] in (15, 9)
                and (r.get("end") or 0) >= first_end):
            head._rank_to(r, RankState.STOPPED)
    return _failure_message(ff)


def _phase_delay(head, now, actions):
    if head.stop_request:
        _finish(head, now, actions, RunState.STOPPED, "stopped by %s" % head.stop_request)
        return True
    if now >= head.phase_until:
        _start_attempt(head, now, actions, head.doc["attempt"] + 1)
        return True
    return False


def _finish(head, now, actions, outcome, message):
    head._run_to(outcome)
    head.doc.update(message=message, ended=now)
    if head.doc["attempts"] and head.doc["attempts"][-1]["state"] == RunState.RUNNING:
        head.doc["attempts"][-1].update(state=outcome, end=now, message=message)
    head.phase = Phase.DONE
    head.phase_until = now + DONE_LINGER
    actions.append(("exit", outcome))
    actions.append(("publish",))


def _phase_done(head, now, actions):
    connected = [n for n, h in head.others() if n not in head.doc["lost"] and h.connected]
    if not connected or now > head.phase_until:
        actions.append(("done",))
    return False


_PHASES = {Phase.JOIN: _phase_join, Phase.RUN: _phase_run, Phase.STOPPING: _phase_stopping,
           Phase.DELAY: _phase_delay, Phase.DONE: _phase_done}
