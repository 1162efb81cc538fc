"""Pure: how each launcher starts a job's ranks, as the processes each host's supervisor starts.

A launcher says which processes run on which host (argv, environment, working directory,
where their output goes) and which files they need (hostfile, rank table). Nothing else:
starting, watching, stopping and restarting them is the supervisor's
(`orchestrator/agent`), the same for every launcher. One module per launcher, each behind
`base.Launcher`; `LAUNCHERS` is the one place a launcher's name is looked up:

- ranktable (`ranktable.py`): every rank is a process of its host's supervisor (seeds 000/001);
- mpirun (`mpirun.py`): one mpirun, a process of the launch host's supervisor; each rank runs
  under `agent.py rank` (its pid and exit status reported to its own host's supervisor);
- msrun (`msrun.py`), torchrun (`torchrun.py`): one per host, each worker under `agent.py rank`.

Paths inside an attempt (restarts make attempts 1, 2, ...) are relative to the attempt's
directory on the host, `<workdir>/.orch/<run id>/a<K>`; ATTEMPT_DIR in an argv stands for it.
What `orch plan` shows of all this is in `show.py`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from ..agent.layout import ATTEMPT_VAR, DIR_VAR, RANK_DIRS_VAR, REPLACED_VAR, RUN_VAR
from ..devices import super_pod_problems
from ..errors import PlanError
from ..hccl import hccl_env
from ..hostlayout import run_dir
from ..model import Cluster
from ..rankplan import RankPlan, replaced
from .base import (ATTEMPT_DIR, HEAD_ADDR, Context, HeadReach, Launch, Launcher, Proc, Spares, head_reach,
                   interface_env, servers)
from .mpirun import Mpirun
from .msrun import Msrun, msrun_task
from .ranktable import Ranktable
from .torchrun import Torchrun

LAUNCHERS: dict[str, Launcher] = {x.name: x for x in (Mpirun(), Ranktable(), Msrun(), Torchrun())}

AUTO_INTERFACE = "<auto>"  # what `orch plan` shows for job.interface: auto (each host says at launch)

__all__ = ["ATTEMPT_DIR", "ATTEMPT_VAR", "AUTO_INTERFACE", "DIR_VAR", "HEAD_ADDR", "LAUNCHERS", "REPLACED_VAR",
           "RUN_VAR", "HeadReach", "Launch", "Launcher", "Proc", "Spares", "build", "head_reach", "launch_files",
           "launcher", "msrun_task", "planned_interfaces", "spare_launch"]


def launcher(cluster: Cluster) -> Launcher:
    """The job's launcher (the model allows no name outside LAUNCHERS)."""
    return LAUNCHERS[cluster.job.launcher]


def planned_interfaces(cluster: Cluster, plan: RankPlan) -> dict[str, tuple[str, str | None]]:
    """job.interface as far as it is known without asking the hosts."""
    name = cluster.job.interface
    if not name:
        return {}
    return {h.name: (AUTO_INTERFACE if name == "auto" else name, None) for h in plan.hosts}


def build(cluster: Cluster, plan: RankPlan, run_id: str, *, root: Mapping[str, bool],
          device_ips: Mapping[str, Mapping[int, str]] | None = None,
          interfaces: Mapping[str, tuple[str, str | None]] | None = None, aarch64: bool = False,
          head_interface_address: str | None = None, only: str | None = None, spares: bool = True,
          share: str | None = None) -> Launch:
    """interfaces: {host: (job.interface there, its network)}, as `up`'s prepare step found them
    (default: a name the cluster file gives; `auto` is only known on the hosts);
    head_interface_address: the launch host's address on job.interface, as prepare read it.
    `only`: that host's processes alone, no files, no spares (what a spare runs in a host's place);
    `spares=False`: the launch without what the spares are given (spare_launch). `share`: the
    launch host's ssh connections to the others that its launcher may share (prepare.Prepared.share)."""
    if spares and only is None and plan.spares:
        ready = spare_launch(cluster, plan, run_id, root=root, device_ips=device_ips, interfaces=interfaces,
                             aarch64=aarch64, head_interface_address=head_interface_address)
        return replace(build(cluster, plan, run_id, root=root, device_ips=device_ips, interfaces=interfaces,
                             aarch64=aarch64, head_interface_address=head_interface_address, spares=False,
                             share=share),
                       spares=ready)
    job = cluster.job
    head_at = head_reach(cluster, plan.launch_host, plan.all_hosts, head_interface_address)
    if interfaces is None:
        interfaces = {h: v for h, v in planned_interfaces(cluster, plan).items() if v[0] != AUTO_INTERFACE}
    # what orch adds to every rank's environment (the user's own values, job/host env, win), and
    # per host NCCL/HCCL/Gloo pinned to job.interface
    added = {**hccl_env(cluster, len(plan.hosts)), **({RANK_DIRS_VAR: "1"} if job.rank_dirs else {})}
    mine = (plan.host(only),) if only else plan.all_hosts
    names = {h.name for h in mine}
    host_added = {h.name: {**(interface_env(interfaces[h.name][0]) if h.name in interfaces else {}), **added}
                  for h in plan.hosts if h.name in names}
    ctx = Context(cluster, plan, run_id, root, device_ips, interfaces, aarch64, head_at.rendered,
                  run_dir(cluster, run_id), added, host_added,
                  {"PYTHONFAULTHANDLER": "1"} if job.stall_timeout else {}, only, share)
    kind = launcher(cluster)
    procs, files = kind.procs(ctx), kind.files(ctx)
    return Launch({h.name: tuple(procs.get(h.name, ())) for h in mine}, {h.name: files.get(h.name, {}) for h in mine},
                  secret_env=kind.secret_env(ctx), head=head_at)


def launch_files(cluster: Cluster) -> dict[str, object]:
    """agent.tables.render's spec: the launch files that name hosts, for this job (none for
    msrun and torchrun: their argv names the launch host only, which is never replaced)."""
    return launcher(cluster).launch_files(cluster)


def spare_launch(cluster: Cluster, plan: RankPlan, run_id: str, *, device_ips: Mapping[str, Mapping[int, str]] | None,
                 aarch64: bool, **kw: Any) -> Spares:
    """Each spare's processes in the place of each host it may replace (plan.can_replace), and the
    facts the head renders the launch files from (the spares' device IPs and super devices
    included: a spare without them is a PlanError now, not at 3 a.m.)."""
    slot_procs: dict[str, dict[str, tuple[Proc, ...]]] = {}
    for spare in plan.spares:
        slot_procs[spare.name] = {}
        for h in plan.hosts:
            if plan.can_replace(h.name, spare):
                swapped = replaced(plan, {h.name: spare.name})
                got = build(cluster, swapped, run_id, device_ips=device_ips, aarch64=aarch64, only=spare.name,
                            **kw)
                slot_procs[spare.name][h.name] = got.procs[spare.name]
    spec = launch_files(cluster)
    if spec.get("rank_table"):
        spec = {**spec, "aarch64": aarch64}
    with_ips = device_ips if spec.get("rank_table") else None
    spare_plan = RankPlan(ranks=(), hosts=plan.spares, launcher=plan.launcher, platform=plan.platform)
    if spec.get("rank_table") and cluster.job.rank_table_version == "1.2":
        problems = super_pod_problems(plan.spares)
        if problems:
            raise PlanError("the spares' rank table 1.2 facts are missing:\n" + "\n".join(f"  - {p}" for p in problems))
    return Spares(slot_procs, spec, tuple(servers(plan, with_ips)), tuple(servers(spare_plan, with_ips)))
