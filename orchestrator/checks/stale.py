"""stale: processes of an earlier orch run still alive on the host (found by ORCH_RUN_ID in
their environment)."""

from __future__ import annotations

from .. import probes, sh
from ..agent.layout import RUN_VAR
from ..probes import Section
from ..model import Host
from .base import Check, CheckResult, Probe, register, result, section

STALE = Probe("stale", lambda plan, host: [("stale", (
    "echo self=$$\n"
    f"{sh.env_values(RUN_VAR)}\ntrue"))])


def judge_stale(host: Host, sec: Section, own: str = "") -> list[CheckResult]:
    """`own`: the id of the run `orch up` is starting (its check's python3 carries it: reach.holds)."""
    runs = {r: p for r, p in probes.parse_stale(sec.body).items() if r != own}
    if not runs:
        return [result("stale", host, "pass", "no processes of an earlier orch run")]
    out = []
    for run_id, pids in sorted(runs.items()):
        shown = ", ".join(map(str, sorted(pids)[:8])) + (" ..." if len(pids) > 8 else "")
        out.append(result("stale", host, "warn", f"{len(pids)} process(es) of orch run {run_id} still alive "
                                                 f"(pid {shown}): stop them with `orch down --run {run_id}`"))
    return out


register(Check("stale", probes=(STALE,), judge=lambda plan, run: judge_stale(run.host, section(run.sections, "stale"), plan.run_id)))
