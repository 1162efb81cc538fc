"""What `orch plan` shows and run records keep of a launch (pure): every host's processes as
records (secrets masked), plan.json, commands.json and the launcher's files, as `orch plan --out`
writes them."""

from __future__ import annotations

import json
import posixpath
from typing import Any, Mapping

from .. import sh
from ..hostlayout import run_dir
from ..model import Cluster
from ..rankplan import RankPlan
from . import build, launcher, planned_interfaces
from .base import ATTEMPT_DIR, head_reach

PLAN_RUN_ID = "<run-id>"


def launch_commands(cluster: Cluster, plan: RankPlan, *, root: bool, redact: bool = True,
                    device_ips: Mapping[str, Mapping[int, str]] | None = None,
                    run_id: str = PLAN_RUN_ID) -> dict[str, list[dict[str, Any]]]:
    """{host name: [process record]}: exactly what each host's supervisor starts for attempt 1
    of a run (`orch up` runs these very argv lists), hosts in plan order. A record is
    {"key", "argv", "env", "cwd", "stdout"} plus "rank" for a rank the supervisor starts
    itself. With `redact`, Secret values (env, command words holding one) show as sh.MASK."""
    roots = {h.name: root for h in plan.hosts}
    if launcher(cluster).needs_device_ips(cluster) and device_ips is None:
        device_ips = {h.name: {d: "<device ip>" for d in h.devices} for h in plan.all_hosts}
    launch = build(cluster, plan, run_id, root=roots, device_ips=device_ips,
                   interfaces=planned_interfaces(cluster, plan))
    adir = posixpath.join(run_dir(cluster, run_id), "a1")
    out: dict[str, list[dict[str, Any]]] = {}
    for h in plan.hosts:
        recs = []
        for p in launch.procs[h.name]:
            env, argv = (sh.shown_env(p.env), map(sh.shown, p.argv)) if redact else (dict(p.env), p.argv)
            rec: dict[str, Any] = {"key": p.key, "argv": [a.replace(ATTEMPT_DIR, adir) for a in argv], "env": env,
                                   "cwd": p.cwd, "stdout": posixpath.join(adir, p.log)}
            if p.rank is not None:
                rec["rank"] = p.rank
            recs.append(rec)
        out[h.name] = recs
    return out


def recorded_commands(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """What run.json keeps of the processes in the supervisors' configurations: {host: [{"key",
    "command", "cwd"}]}, each command line with its Secret words masked."""
    return {h: [{"key": p["key"], "command": sh.shown_join(p["argv"]), "cwd": p["cwd"]} for p in cfg["procs"]]
            for h, cfg in configs.items()}


def plan_document(cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
    """plan.json: the cluster, the launcher, the hosts and every rank, in plan order."""
    return {"cluster": cluster.name, "file": str(cluster.path), **plan.to_dict(),
            **launcher(cluster).plan_document(cluster, plan)}


def plan_files(cluster: Cluster, plan: RankPlan, *, device_ips: Mapping[str, Mapping[int, str]] | None,
               root: bool) -> dict[str, str]:
    """{file name: text} of everything `orch up` would use, as `orch plan --out DIR` writes it:
    plan.json, commands.json (secrets masked; the very processes each host's supervisor
    starts, and where the other hosts reach the launch host: what HEAD_ADDR in them stands for),
    hostfile (mpirun), rank_table.json (ranktable, only when device_ips is given)."""
    files = {"plan.json": json.dumps(plan_document(cluster, plan), indent=2) + "\n"}
    head = head_reach(cluster, plan.launch_host, plan.all_hosts)
    commands = {"launcher": plan.launcher, "run_dir": run_dir(cluster, PLAN_RUN_ID),
                "head_address": {"host": plan.launch_host.name, "addresses": list(head.addresses),
                                 "pinned": head.pinned, "in_commands": head.rendered,
                                 "means": f"the other hosts reach {plan.launch_host.name} at "
                                          f"{head.describe(plan.launch_host.name)}"},
                "hosts": launch_commands(cluster, plan, root=root, redact=True,
                                         device_ips=device_ips)}
    kind = launcher(cluster)
    commands.update(kind.plan_commands(cluster, plan))
    files["commands.json"] = json.dumps(commands, indent=2) + "\n"
    files.update(kind.plan_files(cluster, plan, device_ips))
    return files
