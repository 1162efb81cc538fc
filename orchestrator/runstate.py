"""Pure: what the hosts' supervisors say about a run -> one view of it (run state, each rank).

The launch host's supervisor (the head) decides the run's state and keeps every rank's;
each other host's supervisor keeps its own ranks (the freshest word on them). A head that
is gone before the run ended means the run was lost; a host that cannot be reached makes
its ranks `unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .agent.protocol import STATE_VERSION
from .agent.states import RankState, RunState, TERMINAL, describe, rank_ranges, run_state
from . import __version__
from .hostsets import fold

__all__ = ["EXIT", "FINAL", "RunView", "describe", "from_head", "merge", "skew"]

FINAL = tuple(s.value for s in TERMINAL)
# orch status's exit code for a run in each state (see docs): 0 fine, 1 went wrong, 4 stopped
EXIT = {s.value: code for s, code in {
    RunState.RUNNING: 0, RunState.STARTING: 0, RunState.SUCCEEDED: 0, RunState.FAILED: 1, RunState.LOST: 1,
    RunState.STALLED: 1, RunState.TIMEOUT: 1, RunState.UNKNOWN: 1, RunState.STOPPED: 4,
    RunState.INTERRUPTED: 4}.items()}


def skew(doc: Mapping) -> str | None:
    """One line when a state document was written by a supervisor whose format this orch does
    not read (a newer orch): which version wrote it and what to do. None when it reads it (every
    format up to ours; documents before versioning are format 0, read the same way)."""
    v = doc.get("v")
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v <= STATE_VERSION):
        return None

    by = doc.get("orch") or "a newer orch"
    return (f"run {doc.get('run') or '?'} was started by orch {by} (state format {v}); this orch {__version__} "
            f"reads formats up to {STATE_VERSION}: run `orch status`, `logs` and `down` with orch {by} or newer")


@dataclass
class RunView:
    state: str
    message: str = ""
    attempt: int = 0
    attempts: list[dict] = field(default_factory=list)
    first_failure: dict | None = None
    lost: list[str] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)      # rank, host, device, pid, state, exit_code, signal
    unreachable: dict[str, str] = field(default_factory=dict)
    started: float | None = None
    ended: float | None = None
    slurm: dict | None = None   # the run's Slurm job: job_id, state, reason (Slurm inventories)
    run_id: str | None = None   # which run (the head's document names it; api.status sets it too)
    replaced: list[dict] = field(default_factory=list)   # spares in lost hosts' places: attempt, host, by, why
    progress: dict[str, dict] = field(default_factory=dict)   # rank -> what its output says (agent/metrics.py)
    load: dict[str, dict] = field(default_factory=dict)       # host -> its sampled load (agent/load.py)
    nothing_left: bool = False  # the run ended and each of its hosts says nothing of it is left running (merge)

    @property
    def final(self) -> bool:
        return self.state in FINAL

    @property
    def exit_codes(self) -> dict[int, int | None]:
        return {r["rank"]: r.get("exit_code") for r in self.ranks}

    def to_dict(self) -> dict:
        return {"state": self.state, "message": self.message, "attempt": self.attempt, "attempts": self.attempts,
                "first_failure": self.first_failure, "lost": self.lost, "ranks": self.ranks,
                "unreachable": self.unreachable, "started": self.started, "ended": self.ended,
                "progress": self.progress, "load": self.load, "nothing_left": self.nothing_left,
                **({"slurm": self.slurm} if self.slurm is not None else {}),
                **({"replaced": self.replaced} if self.replaced else {})}


def _row(r: Mapping) -> dict:
    return {"rank": r["rank"], "host": r["host"], "device": r.get("device"), "pid": r.get("pid"),
            "state": r.get("state") or "unknown", "exit_code": r.get("exit_code"), "signal": r.get("signal"),
            "attempt": r.get("attempt")}


def from_head(doc: Mapping) -> RunView:
    """The head's state document (state.json, or an event) -> RunView. A document of a format
    this orch does not read says so (skew) instead of guessing."""
    said = skew(doc)
    if said is not None:   # its own word for the state, shown as it is, and who can read the rest
        word = s if isinstance(s := doc.get("state"), str) and s.isidentifier() else "?"
        return RunView(state=word[:40], message=said, attempt=int(doc.get("attempt") or 0)
                       if isinstance(doc.get("attempt"), int) else 0, started=doc.get("started"))
    return RunView(state=run_state(doc.get("state")).value, message=doc.get("message") or "",
                   attempt=int(doc.get("attempt") or 0), attempts=list(doc.get("attempts") or []),
                   first_failure=doc.get("first_failure"), lost=list(doc.get("lost") or []),
                   ranks=[_row(r) for r in doc.get("ranks") or []], started=doc.get("started"),
                   ended=doc.get("ended"), run_id=doc["run"] if isinstance(doc.get("run"), str) else None,
                   replaced=list(doc.get("replaced") or []), progress=_figures(doc.get("progress")),
                   load=_figures(doc.get("load")))


def _figures(m) -> dict[str, dict]:
    return {str(k): dict(v) for k, v in m.items() if isinstance(v, dict)} if isinstance(m, dict) else {}


def merge(head_name: str, docs: Mapping[str, Mapping], unreachable: Mapping[str, str],
          plan_ranks: list[dict], run_id: str | None = None, hosts: Sequence[str] = ()) -> RunView:
    """Every host's `agent.py status` document (or why it could not be read) -> RunView.
    A rank whose process a host says is alive (`alive_ranks`) is never shown ended: `running`
    while the run goes on, `orphaned` after it ended (the message says how to stop it). An
    ended run whose `hosts` all left nothing of it running (each host's document says so now:
    `live_pids`, or, not asked, its supervisor told the head as it ended: `left_nothing`) says
    that (`nothing_left`)."""
    head = docs.get(head_name) or {}
    if head.get("role") == "member":
        head = {}
    if head:
        view = from_head(head)
        if not view.final and not head.get("agent_alive"):
            view.state = "lost"
            view.message = (f"the run's supervisor on {head_name} is gone (killed, or the host restarted) "
                            "before the run ended")
    else:
        view = RunView(state="unknown", ranks=[{**r, "pid": None, "state": "unknown", "exit_code": None,
                                                 "signal": None} for r in plan_ranks])
        if head_name in unreachable:
            view.message = f"the launch host {head_name} cannot be reached: {unreachable[head_name]}"
        else:
            view.message = f"no supervisor state for this run on the launch host {head_name}"
    by_rank = {r["rank"]: r for r in view.ranks}
    if not head:   # no word from the head: each other host's own record of its ranks is the evidence
        view.attempt = max([int(d["attempt"]) for d in docs.values() if d.get("role") == "member"
                            and isinstance(d.get("attempt"), int)] or [0])
    for name, doc in docs.items():
        if name == head_name or doc.get("role") != "member" or doc.get("attempt") != view.attempt:
            continue
        for r in doc.get("ranks") or []:
            if r.get("rank") in by_rank:
                by_rank[r["rank"]].update(_row(r))
    alive = {(name, rank) for name, doc in docs.items() for rank in doc.get("alive_ranks") or []}
    orphans = []
    for r in view.ranks:
        if r["host"] in unreachable:
            r["state"] = "unknown (host unreachable)"
        elif (r["host"], r["rank"]) in alive:
            if view.final:
                r["state"] = RankState.ORPHANED.value
                orphans.append(r)
            else:
                r["state"] = RankState.RUNNING.value
        elif view.final and r["state"] in (RankState.RUNNING, RankState.PENDING):
            r["state"] = (RankState.LOST if r["host"] in view.lost else RankState.STOPPED).value
    said = set(head.get("left_nothing") or ()) if view.final else set()
    view.nothing_left = view.final and not orphans and bool(hosts) and all(
        n not in unreachable and (n in said if n not in docs else docs[n].get("live_pids") == []) for n in hosts)
    if orphans:

        hosts = ", ".join(sorted({r["host"] for r in orphans}))
        rid = run_id or "<run-id>"
        view.message = (view.message + "\n" if view.message else "") + (
            f"{rank_ranges(r['rank'] for r in orphans)} on {hosts} still running after the run ended: "
            f"stop them with `orch down --run {rid}`")
    view.unreachable = dict(unreachable)
    view.run_id = view.run_id or run_id
    return view


def history(view: RunView) -> list[str]:
    """What `orch status` and `orch up` say of a run whose hosts changed: each attempt's host set
    and state, then each replacement and why (nothing when every attempt ran on the planned hosts)."""
    if not view.replaced:
        return []

    lines = [f"attempt {a['attempt']} on {fold(a.get('hosts') or ())}: {a.get('state')}" for a in view.attempts]
    lines += [f"attempt {r['attempt']}: spare {r['by']} took the place of {r['host']} ({r['why']})"
              for r in view.replaced]
    return lines

