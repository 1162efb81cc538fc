"""Pure: what the hosts' supervisors say about a run -> one view of it (run state, each rank).

The launch host's supervisor (the head) decides the run's state and keeps every rank's;
each other host's supervisor keeps its own ranks (the freshest word on them). A head that
is gone before the run ended means the run was lost; a host that cannot be reached makes
its ranks `unknown`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Mapping

FINAL = ("succeeded", "failed", "stopped", "lost", "stalled", "timeout", "interrupted")
# orch status's exit code for a run in each state (see docs): 0 fine, 1 went wrong, 4 stopped
EXIT = {"running": 0, "starting": 0, "succeeded": 0, "failed": 1, "lost": 1, "stalled": 1, "timeout": 1,
        "unknown": 1, "stopped": 4, "interrupted": 4}


def describe(code: int | None, sig: int | None = None) -> str:
    """How a process ended, in words: `exit code 3`, `killed by signal 9 (SIGKILL)`."""
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    if code is None:
        return "no exit code (killed or lost)"
    return f"exit code {code}"


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
    run_id: str | None = None   # which run (api.status sets it)

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
                **({"slurm": self.slurm} if self.slurm is not None else {})}


def _row(r: Mapping) -> dict:
    return {"rank": r["rank"], "host": r["host"], "device": r.get("device"), "pid": r.get("pid"),
            "state": r.get("state") or "unknown", "exit_code": r.get("exit_code"), "signal": r.get("signal"),
            "attempt": r.get("attempt")}


def from_head(doc: Mapping) -> RunView:
    """The head's state document (state.json, or an event) -> RunView."""
    return RunView(state=doc.get("state") or "unknown", message=doc.get("message") or "",
                   attempt=int(doc.get("attempt") or 0), attempts=list(doc.get("attempts") or []),
                   first_failure=doc.get("first_failure"), lost=list(doc.get("lost") or []),
                   ranks=[_row(r) for r in doc.get("ranks") or []], started=doc.get("started"),
                   ended=doc.get("ended"))


def merge(head_name: str, docs: Mapping[str, Mapping], unreachable: Mapping[str, str],
          plan_ranks: list[dict]) -> RunView:
    """Every host's `agent.py status` document (or why it could not be read) -> RunView."""
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
    for name, doc in docs.items():
        if name == head_name or doc.get("role") != "member" or doc.get("attempt") != view.attempt:
            continue
        for r in doc.get("ranks") or []:
            if r.get("rank") in by_rank:
                by_rank[r["rank"]].update(_row(r))
    for r in view.ranks:
        if r["host"] in unreachable:
            r["state"] = "unknown (host unreachable)"
        elif view.final and r["state"] in ("running", "pending"):
            r["state"] = "lost" if r["host"] in view.lost else "stopped"
    view.unreachable = dict(unreachable)
    return view
