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
An attempt that lost hosts (`lost`, or a failure while a host was lost) starts again with each lost
host replaced by a spare that fits it (its devices; never the launch host), the spare running the
lost host's ranks, and the hostfile / rank table rendered here for the new host set (tables.py);
replacements use spares, not restarts. With no spare left for a lost host the run ends `lost`.

Actions:
    ("start", attempt, head_address, setup)  every host of the attempt starts its processes;
                                       setup: {"slots": {spare: the host whose ranks it runs},
                                       "files": {name: text} (only when the host set changed),
                                       "files_to": "all" | "head", "replaced": "old->new,..."}
    ("stop", reason)                   every host stops them (TERM, KILL after the grace)
    ("dump",)                          every host captures its ranks' stacks
    ("exit", state)                    members: the run is over
    ("publish",)                       write state.json, tell the watchers
    ("done",)                          the head's work is over
"""

from __future__ import annotations

from enum import Enum

from .states import (ATTEMPT_TRANSITIONS, RANK_TRANSITIONS, RETRYABLE, RUN_TRANSITIONS, RankState, RunState,
                     allowed, check, describe, rank_ranges)
from . import load, metrics, tables
from .protocol import FILES_MAX, STATE_VERSION, pack_files
from .layout import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

LAUNCHER_REPORT_GRACE = 5.0   # after a launcher ends, how long its ranks have to report
LOST_RANKS_STOP = 5.0         # a silent host's supervisor stops its ranks within grace + this of the head's verdict
DONE_LINGER = 3.0             # after the end, how long the head waits for members to hear it
TOO_CLOSE_TO_ORDER = 0.5      # two hosts' ranks failing closer than this: hosts' clocks may differ by more


class Phase(str, Enum):
    JOIN = "join"
    RUN = "run"
    STOPPING = "stopping"
    DELAY = "delay"
    DONE = "done"


class HostView:
    __slots__ = ("joined", "connected", "last", "report", "launchers", "address")

    def __init__(self, now: float) -> None:
        self.joined = False
        self.connected = False
        self.last = now
        self.report: dict[str, Any] | None = None   # the last report of the current attempt
        self.launchers: list[dict[str, Any]] = []   # its processes that are no rank (mpirun...): _launchers
        self.address: str | None = None             # the head's address this host reached it on


class Head:
    """What the head knows of the run. `doc` is the run's document (state.json, watchers)."""

    def __init__(self, cfg: dict[str, Any], now: float) -> None:
        self.run_id = cfg["run_id"]
        self.me = cfg["host"]
        self.on_failure = cfg.get("on_failure", "stop")
        self.restarts = int(cfg.get("restarts") or 0)
        self.restart_delay = float(cfg.get("restart_delay") or 0)
        self.stall_timeout = float(cfg.get("stall_timeout") or 0)
        self.timeout = float(cfg.get("timeout") or 0)
        self.grace = float(cfg.get("grace", 5))
        self.lost_after = float(cfg.get("lost_after", 10))
        self.addresses: list[str] = list(cfg.get("head_addresses") or [])
        self.active: list[str] = list(cfg["hosts"])     # the hosts of the current attempt, in plan order
        self.slot_of = {h: h for h in self.active}      # host -> the planned host whose ranks it runs
        self.spares: list[str] = list(cfg.get("spares") or [])  # spares not used (nor lost) yet, inventory order
        self.fits = {s: set(v) for s, v in (cfg.get("spare_fits") or {}).items()}  # spare -> hosts it may replace
        self.tables: dict[str, Any] = cfg.get("tables") or {}   # which launch files name hosts (tables.render)
        self.servers = {s["name"]: s for s in cfg.get("servers") or ()}           # planned hosts' facts
        self.spare_servers = {s["name"]: s for s in cfg.get("spare_servers") or ()}
        self.replacements = 0                           # attempts started by a replacement (they use no restart)
        self.replacing = False                          # the delay before an attempt with spares in lost hosts' places
        self.setup: dict[str, Any] = {}                 # the current attempt's (attempt_setup)
        self.hosts = {h: HostView(now) for h in self.active + self.spares}
        self.hosts[self.me].joined = self.hosts[self.me].connected = True
        self.rank_host = {r["rank"]: r["host"] for r in cfg["all_ranks"]}
        self.doc: dict[str, Any] = {"v": STATE_VERSION, "orch": cfg.get("orch_version"), "run": self.run_id,
                    "state": RunState.STARTING, "head": self.me, "attempt": 0, "attempts": [],
                    "ranks": [dict(r) for r in cfg["all_ranks"]], "lost": [], "message": "",
                    "first_failure": None, "started": now, "ended": None, "launcher": cfg.get("launcher"),
                    "restarts": self.restarts, "head_address": None, "reached": {},
                    "hosts": list(self.active), "spares": list(self.spares), "replaced": [], "spares_lost": [],
                    "left_nothing": []}   # members whose supervisor said, as it ended, nothing of the run lives there
        # indexes of doc["ranks"], each turn reading them instead of every rank (1,024 at 128 x 8):
        # rank -> its record (the records are never replaced); the records that turned failed this
        # attempt (_merge, the one place a rank fails; _failures keeps those still failed, by end)
        self.rank_rec: dict[int, dict[str, Any]] = {r["rank"]: r for r in self.doc["ranks"]}
        self.failed: dict[int, dict[str, Any]] = {}
        self.phase = Phase.JOIN
        self.phase_until = now + float(cfg.get("join_timeout", 60))
        self.stop_request: str | None = None
        self.lost_why: dict[str | None, str] = {}  # host -> what was seen when it was counted lost (None: the head's own network)
        self.outcome: tuple[RunState, str] | None = None  # (state, message) of the attempt that is ending
        self.settle_until = 0.0
        self.stop_sent = False
        self.launcher_end: float | None = None
        self.attempt_started = now
        self.merged = 0   # reports merged into doc: their figures (progress, load) go out with the next beat

    # ---- helpers
    @property
    def state(self) -> RunState:
        return RunState(self.doc["state"])

    def others(self) -> list[tuple[str, HostView]]:
        """The other hosts of the current attempt (not the spares waiting, not a replaced host)."""
        return [(n, self.hosts[n]) for n in self.active if n != self.me]

    def can_join(self, host: str) -> bool:
        """A member may join once: a second join for a host (a replay, or someone posing as it) is refused."""
        h = self.hosts.get(host)
        return h is not None and host != self.me and not h.joined

    def _run_to(self, new: RunState) -> None:
        self.doc["state"] = check(RUN_TRANSITIONS, self.doc["state"], new, "run")

    def _rank_to(self, r: dict[str, Any], new: RankState) -> None:
        r["state"] = check(RANK_TRANSITIONS, RankState(r["state"]), new, "rank %d" % r["rank"])


# --------------------------------------------------------------------------- events

def joined(host: str, address: str | None) -> tuple[Any, ...]:
    return ("joined", host, address)


def reported(host: str, report: dict[str, Any]) -> tuple[Any, ...]:
    return ("report", host, report)


def gone(host: str) -> tuple[Any, ...]:
    return ("gone", host)


def stop_asked(reason: str) -> tuple[Any, ...]:
    return ("stop", reason)


def _apply(head: Head, ev: tuple[Any, ...], now: float) -> bool:
    kind = ev[0]
    h: HostView | None
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
        # a member's last report, once nothing of the run is left there (every attempt's): `orch status`
        # of the ended run need not ask that host again
        said = rep.get("left_nothing") is True and host not in head.doc["left_nothing"]
        if said:
            head.doc["left_nothing"].append(host)
        if rep.get("attempt") != head.doc["attempt"]:
            return said
        h.report = rep
        h.launchers = [p for p in rep["procs"] if p.get("rank") is None]
        head.merged += 1
        metrics.merge(head.doc, head.rank_host, host, rep.get("progress"))   # published with the next beat
        load.merge(head.doc, host, rep.get("load"))
        return _merge(head, host, rep) or said
    raise ValueError("unknown event %r" % (kind,))


def _merge(head: Head, host: str, rep: dict[str, Any]) -> bool:
    """A host's report of its own ranks -> the run's rank records. Only that host's ranks, only
    ranks not ended yet (a late report never undoes or rewrites an end), and only transitions
    the table allows."""
    changed = False
    for x in rep["ranks"]:
        r = head.rank_rec.get(x["rank"])
        if r is None or head.rank_host.get(x["rank"]) != host or x.get("attempt") != head.doc["attempt"]:
            continue
        old, new = RankState(r["state"]), RankState(x["state"])
        if r["end"] is not None or not allowed(RANK_TRANSITIONS, old, new):
            continue
        for k in ("pid", "state", "exit_code", "signal", "start", "end"):
            if r.get(k) != x.get(k):
                r[k] = x.get(k)
                changed = True
        if new == RankState.FAILED:
            head.failed[r["rank"]] = r
    return changed


# --------------------------------------------------------------------------- decide

def decide(head: Head, events: list[tuple[Any, ...]], now: float) -> tuple[Head, list[tuple[Any, ...]]]:
    """Apply the events, then take the phase's decisions. Returns (head, actions)."""
    actions: list[tuple[Any, ...]] = []
    changed = False
    for ev in events:
        changed = _apply(head, ev, now) or changed
    changed = _notice_lost(head, now) or changed
    step = _PHASES[head.phase]
    changed = step(head, now, actions) or changed
    if changed and not any(a[0] == "publish" for a in actions):
        actions.append(("publish",))
    return head, actions


def _seen_lost(head: Head, h: HostView, now: float) -> str | None:
    """What was seen of a joined host that is gone, no more (a cut link closes nothing); None: it is not."""
    if not h.joined:
        return None
    if not h.connected:
        return "the connection to its supervisor closed"
    if now - h.last > head.lost_after:
        return "its supervisor was silent for %.1fs" % (now - h.last)
    return None


def _notice_lost(head: Head, now: float) -> bool:
    """A joined member whose connection closed, or that stayed silent for lost_after seconds; a
    spare that is gone is no longer offered (the run goes on)."""
    if head.phase == Phase.DONE:
        return False
    changed = False
    heard = [h for n, h in head.others() if h.joined and n not in head.doc["lost"]]
    if (len(heard) >= 2 and all(h.connected for h in heard) and all(now - h.last > head.lost_after / 2 for h in heard)
            and any(now - h.last > head.lost_after for h in heard)):
        # silence from every other host at once: what they share is this host's network
        head.lost_why[None] = ("the launch host %s heard nothing from any of the %d other hosts for %.1fs or more "
                               "(their connections still open): it lost its own network, or they all lost theirs "
                               "at once" % (head.me, len(heard), min(now - h.last for h in heard)))
        for n, h in head.others():
            if h.joined and n not in head.doc["lost"]:
                head.doc["lost"].append(n)
                head.lost_why[n] = "silent for %.1fs" % (now - h.last)
        return True
    for name, h in head.others():
        why = None if name in head.doc["lost"] else _seen_lost(head, h, now)
        if why:
            head.doc["lost"].append(name)
            head.lost_why[name] = why
            changed = True
    for name in list(head.spares):
        why = _seen_lost(head, head.hosts[name], now)
        if why:
            head.spares.remove(name)
            head.doc["spares"] = list(head.spares)
            head.doc["spares_lost"].append({"host": name, "why": why})
            changed = True
    return changed


def _phase_join(head: Head, now: float, actions: list[tuple[Any, ...]]) -> bool:
    missing = [n for n in head.active if not head.hosts[n].joined]   # spares may join later
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


def head_address(head: Head) -> str:
    """The launch host's address as the other hosts reached it (most of them; ties: the
    preferred one), for torchrun's and msrun's master address and MASTER_ADDR."""
    counts: dict[str, int] = {}
    for _, h in head.others():
        if h.address:
            counts[h.address] = counts.get(h.address, 0) + 1
    if not counts:
        return head.addresses[0] if head.addresses else "127.0.0.1"
    order = {a: i for i, a in enumerate(head.addresses)}
    return sorted(counts, key=lambda a: (-counts[a], order.get(a, len(order)), a))[0]


def _start_attempt(head: Head, now: float, actions: list[tuple[Any, ...]], k: int,
                   setup: dict[str, Any] | None = None) -> None:
    head.phase = Phase.RUN
    if head.doc["state"] == RunState.STARTING:
        head._run_to(RunState.RUNNING)
    head.doc.update(attempt=k, first_failure=None)
    head.doc["head_address"] = address = head_address(head)
    head.doc["attempts"].append({"attempt": k, "state": RunState.RUNNING, "start": now, "end": None,
                                 "message": "", "first_failure": None, "hosts": list(head.active)})
    for r in head.doc["ranks"]:
        r.update(state=RankState.PENDING, pid=None, exit_code=None, signal=None, start=None, end=None, attempt=k)
    head.failed = {}
    for _, h in head.hosts.items():
        h.report = None
        h.launchers = []
    head.launcher_end = None
    head.attempt_started = now
    head.setup = setup if setup is not None else attempt_setup(head)
    actions.append(("start", k, address, head.setup))
    actions.append(("publish",))


def attempt_setup(head: Head) -> dict[str, Any]:
    """What the hosts of an attempt need beyond its number: which spare runs whose ranks and, when
    the host set is not the planned one, the launch files rendered for it (tables.render)."""
    moved = {h: slot for h, slot in head.slot_of.items() if h != slot}
    setup: dict[str, Any] = {"slots": moved, "files": "", "files_to": "head" if head.tables.get("hostfile") else "all",
             "replaced": ",".join("%s->%s" % (r["host"], r["by"]) for r in head.doc["replaced"])}
    if moved and head.tables:
        servers = []
        for h in head.active:
            planned = head.servers[head.slot_of[h]]
            servers.append(dict(head.spare_servers[h], ranks=planned["ranks"]) if h in moved else planned)
        setup["files"] = pack_files(tables.render(head.tables, servers))   # compressed: a big rank table fits
    return setup


def pick_spares(head: Head, lost: list[str], now: float) -> dict[str, str] | None:
    """{lost host: the spare that takes its place}: the first spare still offered (joined, heard
    from, not lost) that fits it; None when some lost host has no spare left."""
    free = [s for s in head.spares if _seen_lost(head, head.hosts[s], now) is None and head.hosts[s].joined]
    swaps: dict[str, str] = {}
    for name in lost:
        slot = head.slot_of.get(name, name)
        fit = next((s for s in free if slot in head.fits.get(s, ())), None)
        if fit is None:
            return None
        free.remove(fit)
        swaps[name] = fit
    return swaps


def replace_hosts(head: Head, swaps: dict[str, str], now: float) -> None:
    """Each lost host of `swaps` leaves the run; its spare takes its place and its ranks."""
    k = head.doc["attempt"]
    for old, new in swaps.items():
        i = head.active.index(old)
        head.active[i] = new
        head.slot_of[new] = head.slot_of.pop(old)
        head.spares.remove(new)
        for r in head.doc["ranks"]:
            if r["host"] == old:
                r["host"] = new
                head.rank_host[r["rank"]] = new
        head.doc["replaced"].append({"attempt": k + 1, "host": old, "by": new,
                                     "why": head.lost_why.get(old, "lost"), "at": now})
    head.doc["hosts"] = list(head.active)
    head.doc["spares"] = list(head.spares)
    head.doc["lost"] = []
    head.replacements += 1


def _no_spare_said(head: Head, lost: list[str]) -> str:
    """Why some lost host got no spare, from what the head knows of each spare."""
    free = [s for s in head.spares if head.hosts[s].joined and head.hosts[s].connected]
    parts = []
    for s in free:
        fit = [n for n in lost if head.slot_of.get(n, n) in head.fits.get(s, ())]
        parts.append("%s is free and fits %s" % (s, ", ".join(fit)) if fit else
                     "%s is free but fits none of them (other devices)" % s)
    parts += ["%s took %s's place in attempt %d" % (r["by"], r["host"], r["attempt"]) for r in head.doc["replaced"]]
    parts += ["%s was lost (%s)" % (x["host"], x["why"]) for x in head.doc["spares_lost"]]
    parts += ["%s never joined" % s for s in head.spares if not head.hosts[s].joined]
    said = "; ".join(parts) if parts else "none"
    if len(lost) > 1 and free:
        said = "%d hosts lost, %d spare(s) free: %s" % (len(lost), len(free), said)
    return "no spare host left to take the place of %s (spares: %s)" % (", ".join(lost), said)


# ---- the duties of a running attempt

def _failures(head: Head, now: float) -> list[tuple[float, dict[str, Any], str]]:
    """(when, rank record, how) of every failed rank, the first to end first."""
    out = [((r.get("end") or now), r, describe(r["exit_code"], r["signal"]))
           for r in head.failed.values() if r["state"] == RankState.FAILED]
    return sorted(out, key=lambda f: (f[0], f[1]["rank"]))


def _name_first_failure(head: Head, now: float) -> dict[str, Any] | None:
    fails = _failures(head, now)
    if not fails:
        return None
    _, r, how = fails[0]
    head.doc["first_failure"] = ff = {"rank": r["rank"], "host": r["host"], "device": r.get("device"),
                                      "exit_code": r["exit_code"], "signal": r["signal"], "how": how,
                                      "attempt": head.doc["attempt"]}
    return ff


def _failure_message(ff: dict[str, Any]) -> str:
    return "rank %d on %s (device %s) failed: %s" % (ff["rank"], ff["host"], ff["device"], ff["how"])


def _launchers(head: Head) -> dict[str, tuple[str, dict[str, Any]]]:
    """{key: (host, proc record)} of every launcher process (mpirun, msrun, torchrun), every host."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, h in head.hosts.items():   # h.launchers: of this attempt's last report (_apply), or none
        for p in h.launchers:
            out[p["key"]] = (name, p)
    return out


def duty_stop_asked(head: Head, now: float) -> tuple[Any, ...] | None:
    if head.stop_request:
        return RunState.STOPPED, "stopped by %s" % head.stop_request, 0.0
    return None


def duty_lost(head: Head, now: float) -> tuple[Any, ...] | None:
    lost = head.doc["lost"]
    if not lost:
        return None
    ranks = rank_ranges(r["rank"] for r in head.doc["ranks"] if r["host"] in lost)
    if None in head.lost_why:
        return (RunState.LOST, "%s. The run was stopped on this host; a supervisor that loses the launch host stops "
                "its own ranks (%s). Once the network is back, `orch status --run %s` shows them and `orch down "
                "--run %s` cleans up" % (head.lost_why[None], ranks, head.run_id, head.run_id), 0.0)
    seen = "; ".join(("%s: " % n if len(lost) > 1 else "") + head.lost_why.get(n, "lost") for n in lost)
    return (RunState.LOST, "lost contact with host %s (%s): %s. The run was stopped on every other host; a "
            "supervisor that loses the launch host stops its own ranks. Once the host is reachable, `orch status "
            "--run %s` shows them and `orch down --run %s` cleans up" % (", ".join(lost), ranks, seen, head.run_id,
                                                                          head.run_id), 0.0)


def _launcher_may_explain(head: Head, now: float) -> bool | str:
    """The first failure is a rank killed by SIGTERM, which orch had not sent (no stop yet): a
    launcher aborting its job (mpirun that could not launch what a rank asked for) sends it.
    "wait": a launcher runs on, for at most LAUNCHER_REPORT_GRACE after that rank ended; True: a
    launcher failed, and its own verdict (duty_launchers) leads; False: the rank's failure stands."""
    fails = _failures(head, now)
    launchers = _launchers(head)
    if not fails or fails[0][1]["signal"] != 15 or not launchers or head.doc["first_failure"] is not None:
        return False
    if any(p["end"] is not None and (p["exit_code"] != 0 or p["signal"]) for _, p in launchers.values()):
        return True
    if any(p["end"] is None for _, p in launchers.values()) and now - fails[0][0] < LAUNCHER_REPORT_GRACE:
        return "wait"
    return False


def duty_fail_fast(head: Head, now: float) -> tuple[Any, ...] | str | None:
    yields = _launcher_may_explain(head, now)
    if yields:
        return None if yields is True else "wait"
    ff = _name_first_failure(head, now)
    if ff is None:
        return None
    all_ended = all(r["end"] is not None for r in head.doc["ranks"])
    if head.on_failure == "stop" or all_ended:
        return RunState.FAILED, _failure_message(ff), 0.0
    return None


def duty_launchers(head: Head, now: float) -> tuple[Any, ...] | str | None:
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


def duty_success(head: Head, now: float) -> tuple[Any, ...] | None:
    if head.doc["first_failure"] is not None:
        return None
    if not all(r["end"] is not None for r in head.doc["ranks"]):
        return None
    launchers = _launchers(head)
    if launchers and not all(p["end"] is not None for _, p in launchers.values()):
        return None
    return RunState.SUCCEEDED, "all %d ranks exited 0" % len(head.doc["ranks"]), 0.0


def duty_stall(head: Head, now: float) -> tuple[Any, ...] | None:
    if not head.stall_timeout:
        return None
    last = max([head.attempt_started] + [h.report["out"] for _, h in head.hosts.items()
                                         if h.report is not None])
    if now - last <= head.stall_timeout:
        return None
    return (RunState.STALLED, "no rank wrote any output for %gs: stacks captured (in each rank's log, or "
            "stacks.txt beside it with py-spy)" % head.stall_timeout, 2.0)


def duty_timeout(head: Head, now: float) -> tuple[Any, ...] | None:
    if head.timeout and now - head.doc["started"] > head.timeout:
        return (RunState.TIMEOUT, "the job did not finish within job.timeout = %gs (timed out)" % head.timeout, 0.0)
    return None


DUTIES = (duty_stop_asked, duty_lost, duty_fail_fast, duty_launchers, duty_success, duty_stall, duty_timeout)


def _phase_run(head: Head, now: float, actions: list[tuple[Any, ...]]) -> bool:
    for duty in DUTIES:
        verdict = duty(head, now)
        if isinstance(verdict, str):   # "wait"
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


def _end_attempt(head: Head, now: float, actions: list[tuple[Any, ...]], outcome: RunState, message: str,
                 settle: float = 0.0) -> None:
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


def _phase_stopping(head: Head, now: float, actions: list[tuple[Any, ...]]) -> bool:
    assert head.outcome is not None  # _end_attempt set it
    if not head.stop_sent:
        if now < head.settle_until:
            return False
        head.stop_sent = True
        actions.append(("stop", head.outcome[1]))
        return False
    views = [(n, head.hosts[n]) for n in head.active]
    remaining = [n for n, h in views if n not in head.doc["lost"] and h.joined
                 and (h.report is None or h.report.get("live"))]
    if remaining and now <= head.phase_until:
        return False
    for r in head.doc["ranks"]:
        if r["end"] is None:
            head._rank_to(r, RankState.LOST if r["host"] in head.doc["lost"] else RankState.STOPPED)
            r["end"] = now
    outcome, message = head.outcome
    if outcome == RunState.FAILED and head.doc["first_failure"] is not None and _failures(head, now):
        message = _settle_failures(head, now)   # every host has reported by now (a launcher's failure stands)
        head.outcome = (outcome, message)
        head.doc["attempts"][-1].update(message=message, first_failure=head.doc["first_failure"])
    k = head.doc["attempt"]
    lost = list(head.doc["lost"])
    restarts_left = k - head.replacements <= head.restarts
    if lost and not head.stop_request and (outcome == RunState.LOST or outcome in RETRYABLE):
        # the head's own network lost: no spare would be reached either
        swaps = pick_spares(head, lost, now) if head.fits and None not in head.lost_why else None
        if swaps:   # applied when the attempt starts (_phase_delay): a stop in between changes no record
            head.phase = Phase.DELAY
            head.replacing = True
            # a silent host's supervisor stops its own ranks only once it, too, has waited lost_after
            # (then TERM, KILL after the grace): the spare's ranks do not start beside them
            silent = any(not head.lost_why.get(o, "").startswith("the connection") for o in swaps)
            head.phase_until = now + max(head.restart_delay, head.grace + LOST_RANKS_STOP if silent else 0.0)
            head.doc["message"] = "%s; %s: attempt %d starts on the new host set" % (message, "; ".join(
                "spare %s takes the place of host %s" % (n, o) for o, n in swaps.items()), k + 1)
            actions.append(("publish",))
            return True
        if head.fits:
            message = "%s; %s" % (message, _no_spare_said(head, lost))
        elif outcome in RETRYABLE and restarts_left:
            message = "%s; not restarted: lost contact with host %s" % (message, ", ".join(lost))
    elif outcome in RETRYABLE and restarts_left and not head.stop_request:
        head.phase = Phase.DELAY
        head.phase_until = now + head.restart_delay
        head.doc["message"] = "%s; restarting (attempt %d of %d)" % (message, k + 1,
                                                                    head.restarts + 1 + head.replacements)
        actions.append(("publish",))
        return True
    _finish(head, now, actions, outcome, message)
    return True


def _settle_failures(head: Head, now: float) -> str:
    """The failure named is the rank that ended first, on whichever host (the others most often
    died of it: mpirun and msrun kill a failed rank's siblings); ranks killed after it by a
    launcher's TERM/KILL count as stopped, not failed. Called only when a rank failed."""
    ff = _name_first_failure(head, now)
    assert ff is not None  # a rank failed
    fails = _failures(head, now)
    first_end = fails[0][0]
    for r in head.doc["ranks"]:
        if (r["state"] == RankState.FAILED and r["rank"] != ff["rank"] and r["signal"] in (15, 9)
                and (r.get("end") or 0) >= first_end):
            head._rank_to(r, RankState.STOPPED)
    # another host's rank that failed of itself right after: each end is by its own host's clock
    close = [(t, r, how) for t, r, how in fails[1:] if r["host"] != ff["host"] and r["signal"] not in (15, 9)
             and t - first_end < TOO_CLOSE_TO_ORDER]
    if close:
        t, r, how = close[0]
        return "%s; rank %d on %s failed %.2fs later (%s), by each host's own clock: too close to tell which " \
               "failed first" % (_failure_message(ff), r["rank"], r["host"], t - first_end, how)
    return _failure_message(ff)


def _phase_delay(head: Head, now: float, actions: list[tuple[Any, ...]]) -> bool:
    if head.stop_request:
        _finish(head, now, actions, RunState.STOPPED, "stopped by %s" % head.stop_request)
        return True
    if now < head.phase_until:
        return False
    setup = None
    if head.replacing:   # the spares again: one chosen may have been lost during the delay
        head.replacing = False
        lost = list(head.doc["lost"])
        swaps = pick_spares(head, lost, now)
        if swaps is None:
            _finish(head, now, actions, RunState(head.outcome[0]) if head.outcome else RunState.LOST,
                    "%s; %s" % (head.outcome[1] if head.outcome else "lost", _no_spare_said(head, lost)))
            return True
        replace_hosts(head, swaps, now)
        setup = attempt_setup(head)
        if len(setup["files"]) > FILES_MAX:
            _finish(head, now, actions, RunState.LOST, "%s; the launch files for the new host set are %d bytes "
                    "compressed, more than the supervisors pass on (%d)" % (head.outcome[1] if head.outcome else
                                                                           "lost", len(setup["files"]), FILES_MAX))
            return True
    _start_attempt(head, now, actions, head.doc["attempt"] + 1, setup)
    return True


def _finish(head: Head, now: float, actions: list[tuple[Any, ...]], outcome: RunState, message: str) -> None:
    head._run_to(outcome)
    head.doc.update(message=message, ended=now)
    if head.doc["attempts"] and head.doc["attempts"][-1]["state"] == RunState.RUNNING:
        head.doc["attempts"][-1].update(state=outcome, end=now, message=message)
    head.phase = Phase.DONE
    head.phase_until = now + DONE_LINGER
    actions.append(("exit", outcome))
    actions.append(("publish",))


def _phase_done(head: Head, now: float, actions: list[tuple[Any, ...]]) -> bool:
    gone = {r["host"] for r in head.doc["replaced"]}   # a replaced host may hang on, silent, to the end
    connected = [n for n, h in head.hosts.items()
                 if n != head.me and n not in head.doc["lost"] and n not in gone and h.connected]
    if not connected or now > head.phase_until:
        actions.append(("done",))
    return False


_PHASES = {Phase.JOIN: _phase_join, Phase.RUN: _phase_run, Phase.STOPPING: _phase_stopping,
           Phase.DELAY: _phase_delay, Phase.DONE: _phase_done}
