"""`orch up`'s prepare facts (supervisor.prepare_script: the user id, the machine, job.interface,
python3 and the run that holds the workdir now) read by up's check probe, not in a round trip of
their own. Each fact is read once, by the section of the probe that reads it anyway (workdir's
uid, nic's iface, path's python3, which then reads the workdir's lock as well); what no check
reads goes into a section `prepare` of its own. Not a check: it gives no result, so no row in
the report; the facts reach `up` through Report.prepared."""

from __future__ import annotations

from .. import probes, supervisor
from ..probes import ProbeError
from .base import Probe, ProbeRun


def sources(plan) -> dict[str, str]:
    """{prepare fact: the section of up's probe that reads it} (plan.prepare)."""
    job = plan.cluster.job
    return {"uid": "workdir" if "workdir" in plan.checks else "prepare",
            "arch": "prepare",
            "interface": "iface" if job.interface and "nic" in plan.checks else "prepare",
            "python": "path" if "path" in plan.checks else "prepare"}


def reads_lock(plan) -> bool:
    """Does the path section read the workdir's lock (python_sh's live run) for prepare? When
    it reads python3 for prepare (sources): python_sh reads both."""
    return plan.prepare and sources(plan)["python"] == "path"


def _shell(plan, host) -> list[tuple[str, str]]:
    if not plan.prepare:
        return []
    own = tuple(f for f, where in sources(plan).items() if where == "prepare")
    return [("prepare", supervisor.prepare_script(plan.cluster, plan.launch.cluster_address, own))]


PREPARE = Probe("prepare", _shell)


def facts(plan, run: ProbeRun) -> dict | None:
    """A host's prepare facts from its probe's sections, as supervisor.parse_prepare gives them
    from prepare's own round trip; None when a section they come from is missing or cut off."""
    if run.sections is None:
        return None
    src = sources(plan)
    bodies = {}
    for name in dict.fromkeys(src.values()):
        s = run.sections.get(name)
        if s is None or not s.finished:
            return None
        bodies[name] = s.body
    out = supervisor.parse_prepare(bodies["prepare"] + "\n" + bodies.get("path", ""))
    if src["uid"] == "workdir":
        try:
            out["uid"] = probes.parse_workdir(bodies["workdir"]).uid
        except ProbeError:
            return None
    if src["interface"] == "iface":
        out["interface"] = probes.parse_interface(bodies["iface"])
    return out
