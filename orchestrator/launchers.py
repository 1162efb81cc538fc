"""Pure: how each launcher starts a job's ranks, as the processes each host's supervisor starts.

A launcher says which processes run on which host (argv, environment, working directory,
where their output goes) and which files they need (hostfile, rank table). Nothing else:
starting, watching, stopping and restarting them is the supervisor's
(`orchestrator/agent`), the same for every launcher.

- ranktable: every rank is a process of its host's supervisor (seeds 000/001);
- mpirun:    one mpirun, a process of the launch host's supervisor; each rank runs under
             `agent.py rank` (its pid and exit status reported to its own host's supervisor);
- msrun:     one msrun per host, each worker under `agent.py rank` the same way.

Paths inside an attempt (restarts make attempts 1, 2, ...) are relative to the attempt's
directory on the host, `<workdir>/.orch/<run id>/a<K>`; ATTEMPT_DIR in an argv stands for it.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from . import render, sh
from .plan import RankPlan
from .model import Cluster, Host

# the names the hosts' supervisor uses too: one copy, in the agent package
from .agent.layout import (AGENT, ATTEMPT_VAR, DIR_VAR, HEAD_ADDR_TOKEN, RANK_DIRS_VAR, RANK_OUTPUT_VAR, REPLACED_VAR,
                           RUN_VAR)
from .agent.layout import ATTEMPT_DIR_TOKEN as ATTEMPT_DIR
from .agent.layout import ORCH_DIR
# In an argv or env value: the launch host's address as the other hosts reached it (torchrun's and
# msrun's master address, MASTER_ADDR), when the cluster file does not pin one (HeadReach.pinned);
# each host's supervisor puts in the address its connection to the head's supervisor worked on.
HEAD_ADDR = HEAD_ADDR_TOKEN
# orch's own python on the hosts (the supervisor, each rank's `agent.py rank` wrapper, the sync
# receiver, gather, prepare's probe) needs nothing but the standard library: without `site` (-S),
# each start skips the site-packages' .pth files (a third of it, often more)
PY = ("python3", "-S")


def orch_dir(workdir: str) -> str:
    """orch's directory in a workdir on the hosts: one directory per run, the workdir's lock
    (LOCK, as agent.py names it) and Slurm's go files."""
    return posixpath.join(workdir, ORCH_DIR)


def run_dir(cluster: Cluster, run_id: str) -> str:
    """Where a run keeps its supervisor, state and (per attempt) logs on each host."""
    return posixpath.join(orch_dir(cluster.job.workdir), run_id)


@dataclass(frozen=True)
class Proc:
    """One process a host's supervisor starts."""

    key: str                        # rank.N | mpirun | msrun.<host>
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    log: str                        # relative to the attempt directory
    rank: int | None = None
    env_log: bool = False           # save the rank's environment beside its log (seed 001)

    def to_config(self) -> dict[str, Any]:
        return {"key": self.key, "argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd,
                "log": self.log, "rank": self.rank, "env_log": self.env_log}


@dataclass(frozen=True)
class HeadReach:
    """Where the other hosts reach the launch host (its supervisor, torchrun's and msrun's master,
    MASTER_ADDR): `addresses` in the order they try them. `pinned`: the cluster file decides it
    (`why`: mpi_address, job.interface) or there is nothing to choose (every host is this machine,
    or there is one host); that one address is all they try and commands hold it as is. Otherwise
    the head's supervisor adds its other addresses and commands hold HEAD_ADDR (`rendered`)."""

    addresses: tuple[str, ...]
    pinned: bool
    why: str  # mpi_address | local | interface | single | cluster

    @property
    def rendered(self) -> str:
        """What commands and environments hold for the launch host's address."""
        return self.addresses[0] if self.pinned else HEAD_ADDR

    def describe(self, launch: str) -> str:
        """For `orch plan` and `orch check`: where the other hosts reach `launch`, in words."""
        first = self.addresses[0]
        if not self.pinned:
            return (f"the first of {launch}'s addresses they reach, its cluster address {first} first "
                    f"(commands hold {HEAD_ADDR} for it); `mpi_address` on {launch} or `job.interface` pins one")
        return {"mpi_address": f"{first} (its mpi_address)", "local": f"{first} (every host is this machine)",
                "interface": f"{first} (its address on job.interface)",
                "single": f"{first} (the only host)"}.get(self.why, first)


def head_reach(cluster: Cluster, launch: Host, hosts: Sequence[Host], interface_address: str | None = None
               ) -> HeadReach:
    """The one rule for where the other hosts reach the launch host: its mpi_address; 127.0.0.1
    when every host is this machine; its address on job.interface (`interface_address`, as
    prepare read it there; unknown to `orch plan`, which shows a placeholder); the only host's
    address; else its cluster address, unpinned (the head's supervisor offers its others too)."""
    if launch.mpi_address:
        return HeadReach((launch.mpi_address,), True, "mpi_address")
    if all(h.connection == "local" for h in hosts):
        return HeadReach(("127.0.0.1",), True, "local")
    if cluster.job.interface:
        shown = interface_address or f"<{launch.name}'s address on job.interface {cluster.job.interface}>"
        return HeadReach((shown,), True, "interface")
    if len(hosts) == 1:
        return HeadReach((launch.cluster_address,), True, "single")
    return HeadReach((launch.cluster_address,), False, "cluster")


@dataclass(frozen=True)
class Launch:
    """What a launcher needs on each host: the processes its supervisor starts, the files, and
    where the other hosts reach the launch host."""

    procs: Mapping[str, tuple[Proc, ...]]
    files: Mapping[str, Mapping[str, bytes]] = field(default_factory=dict)   # host -> {relpath: bytes}
    # host -> {NAME: secret value}: what `agent.py rank` adds to each rank's environment there
    # (mpirun: secrets never travel on Open MPI's wire)
    secret_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    head: HeadReach | None = None
    spares: Spares | None = None


@dataclass(frozen=True)
class Spares:
    """What the run's head needs to put a spare in a lost host's place on the cluster, with the
    controller detached: which hosts each spare may replace and what it then runs (rendered here
    by `build` for the plan with that one swap: plan.replaced), and the facts the launch files
    that name hosts are rendered from there (agent.tables, the same code `orch plan` uses)."""

    slot_procs: Mapping[str, Mapping[str, tuple[Proc, ...]]]   # spare -> {host it replaces: its processes}
    tables: Mapping[str, object]                               # agent.tables.render's spec
    servers: tuple[dict[str, Any], ...]                        # the planned hosts, plan order
    spare_servers: tuple[dict[str, Any], ...]                  # the spares' facts (their ranks: none)

    def fits(self) -> dict[str, list[str]]:
        return {s: list(slots) for s, slots in self.slot_procs.items()}


def _wrapped(rdir: str, command: Iterable[str]) -> list[str]:
    """A rank's command under `agent.py rank` (mpirun and msrun start ranks, not the supervisor)."""
    return [*PY, posixpath.join(rdir, AGENT), "rank", "--", *command]


AUTO_INTERFACE = "<auto>"  # what `orch plan` shows for job.interface: auto (each host says at launch)


def planned_interfaces(cluster: Cluster, plan: RankPlan) -> dict[str, tuple[str, str | None]]:
    """job.interface as far as it is known without asking the hosts."""
    name = cluster.job.interface
    if not name:
        return {}
    return {h.name: (AUTO_INTERFACE if name == "auto" else name, None) for h in plan.hosts}


def build(cluster: Cluster, plan: RankPlan, run_id: str, *, root: Mapping[str, bool],
          device_ips: Mapping[str, Mapping[int, str]] | None = None,
          interfaces: Mapping[str, tuple[str, str | None]] | None = None, aarch64: bool = False,
          head_interface_address: str | None = None, only: str | None = None, spares: bool = True) -> Launch:
    """interfaces: {host: (job.interface there, its network)}, as `lifecycle.prepare` found them
    (default: a name the cluster file gives; `auto` is only known on the hosts);
    head_interface_address: the launch host's address on job.interface, as prepare read it.
    `only`: that host's processes alone, no files, no spares (what a spare runs in a host's place);
    `spares=False`: the launch without what the spares are given (spare_launch)."""
    job = cluster.job
    if spares and only is None and plan.spares:
        ready = spare_launch(cluster, plan, run_id, root=root, device_ips=device_ips, interfaces=interfaces,
                             aarch64=aarch64, head_interface_address=head_interface_address)
        return replace(build(cluster, plan, run_id, root=root, device_ips=device_ips, interfaces=interfaces,
                             aarch64=aarch64, head_interface_address=head_interface_address, spares=False),
                       spares=ready)
    head_at = head_reach(cluster, plan.launch_host, plan.all_hosts, head_interface_address)
    master = head_at.rendered
    if interfaces is None:
        interfaces = {h: v for h, v in planned_interfaces(cluster, plan).items() if v[0] != AUTO_INTERFACE}
    # NCCL/HCCL/Gloo pinned to job.interface; the user's own values (job/host env) win
    if_env = {h: render.interface_env(n) for h, (n, _) in interfaces.items()}
    rdir = run_dir(cluster, run_id)
    # `only`: one spare in one host's place, rendered once per such pair: its own host alone
    mine = (plan.host(only),) if only else plan.all_hosts
    procs: dict[str, list[Proc]] = {h.name: [] for h in mine}
    files: dict[str, dict[str, bytes]] = {h.name: {} for h in mine}
    secret_env: dict[str, Mapping[str, str]] = {}
    # what orch adds to every rank's environment (the user's own values, job/host env, win)
    added = {**render.hccl_env(cluster, plan), **({RANK_DIRS_VAR: "1"} if job.rank_dirs else {})}
    if_env = {h.name: {**if_env.get(h.name, {}), **added} for h in plan.hosts if h.name in procs}
    stall_env = {"PYTHONFAULTHANDLER": "1"} if job.stall_timeout else {}
    if job.launcher == "mpirun" and only:   # a spare in mpirun's job: mpirun (on the launch host) starts its ranks
        pass
    elif job.launcher == "mpirun":
        head = plan.launch_host
        files[head.name][render.HOSTFILE] = render.hostfile(plan, by_name=cluster.slurm is not None).encode()
        mca, mpi_if_env = render.mpirun_interface(interfaces) if interfaces else (None, {})
        job_x = {**mpi_if_env, **added, **job.env, **stall_env}
        c = _with_env(cluster, job_x)
        argv = render.mpirun_argv(c, plan, hostfile_path=render.hostfile_path(c), root=root.get(head.name, False),
                                  interface=mca, output_dir=ATTEMPT_DIR,
                                  pass_env=(RUN_VAR, DIR_VAR, ATTEMPT_VAR, REPLACED_VAR),
                                  command=_wrapped(rdir, job.command), tag=(RUN_VAR, run_id))
        env = _launcher_path_env(cluster, head.name)
        procs[head.name].append(Proc("mpirun", tuple(argv), env, job.workdir, "mpirun.log"))
        secrets = render.mpirun_secrets(c, plan)
        secret_env = {h.name: secrets for h in plan.all_hosts} if secrets else {}
    elif job.launcher == "ranktable":
        table = render.rank_table_path(cluster)
        if job.platform == "ascend" and not only:
            data = render.rank_table(cluster, plan, device_ips or {}, aarch64).encode()
            for h in plan.all_hosts:
                files[h.name][render.RANK_TABLE] = data
        for r in plan.by_host(only) if only else plan.ranks:
            env = {**if_env[r.host], **render.rank_env(cluster, plan, r, table)}
            if job.platform != "ascend":  # no rank table off Ascend
                env.pop("RANK_TABLE_FILE", None)
            # torch/gloo-style names too, so one script runs under any launcher
            env.setdefault("MASTER_ADDR", master)
            env.setdefault("MASTER_PORT", str(job.master_port))
            env.update({"RANK": str(r.rank), "WORLD_SIZE": str(plan.size), "LOCAL_RANK": str(r.local_rank)})
            env.update(stall_env)
            procs[r.host].append(Proc(f"rank.{r.rank}", tuple(job.command), env, job.workdir,
                                      f"1/rank.{r.rank}/stdout", rank=r.rank, env_log=True))
    elif job.launcher == "msrun":
        n = len(render.msrun_script(job.command))
        for h in plan.hosts:
            if only and h.name != only:
                continue
            argv = render.msrun_argv(cluster, plan, h.name, log_dir=ATTEMPT_DIR, master_addr=master)
            argv = argv[:len(argv) - n] + msrun_task(job.command)
            env = {**if_env[h.name], **render.node_env(cluster, plan, h.name), **stall_env}
            procs[h.name].append(Proc(f"msrun.{h.name}", tuple(argv), env, job.workdir, "msrun.log"))
    elif job.launcher == "torchrun":
        for h in plan.hosts:
            if only and h.name != only:
                continue
            argv = render.torchrun_argv(cluster, plan, h.name, _wrapped(rdir, job.command), master_addr=master)
            env = {**if_env[h.name], **render.node_env(cluster, plan, h.name), **stall_env, RANK_OUTPUT_VAR: "1"}
            procs[h.name].append(Proc(f"torchrun.{h.name}", tuple(argv), env, job.workdir, "torchrun.log"))
    else:  # pragma: no cover - the model allows no other
        raise ValueError(job.launcher)
    return Launch({k: tuple(v) for k, v in procs.items()}, files, secret_env=secret_env, head=head_at)


def launch_files(cluster: Cluster) -> dict[str, object]:
    """agent.tables.render's spec: the launch files that name hosts, for this job (none for
    msrun and torchrun: their argv names the launch host only, which is never replaced)."""
    job = cluster.job
    if job.launcher == "mpirun":
        return {"hostfile": render.HOSTFILE, "by_name": cluster.slurm is not None}
    if job.launcher == "ranktable" and job.platform == "ascend":
        return {"rank_table": render.RANK_TABLE, "version": job.rank_table_version}
    return {}


def spare_launch(cluster: Cluster, plan: RankPlan, run_id: str, *, device_ips: Mapping[str, Mapping[int, str]] | None,
                 aarch64: bool, **kw: Any) -> Spares:
    """Each spare's processes in the place of each host it may replace (plan.can_replace), and the
    facts the head renders the launch files from (the spares' device IPs and super devices
    included: a spare without them is a PlanError now, not at 3 a.m.)."""
    from .plan import replaced

    slot_procs: dict[str, dict[str, tuple[Proc, ...]]] = {}
    for spare in plan.spares:
        slot_procs[spare.name] = {}
        for h in plan.hosts:
            if plan.can_replace(h.name, spare):
                swapped = replaced(plan, {h.name: spare.name})
                got = build(cluster, swapped, run_id, device_ips=device_ips, aarch64=aarch64, only=spare.name, **kw)
                slot_procs[spare.name][h.name] = got.procs[spare.name]
    spec = launch_files(cluster)
    if spec.get("rank_table"):
        spec = {**spec, "aarch64": aarch64}
    with_ips = device_ips if spec.get("rank_table") else None
    servers = tuple(render.servers(plan, with_ips))
    spare_plan = RankPlan(ranks=(), hosts=plan.spares, launcher=plan.launcher, platform=plan.platform)
    if spec.get("rank_table") and cluster.job.rank_table_version == "1.2":
        from .devices import super_pod_problems

        problems = super_pod_problems(plan.spares)
        if problems:
            from .errors import PlanError

            raise PlanError("the spares' rank table 1.2 facts are missing:\n" + "\n".join(f"  - {p}" for p in problems))
    return Spares(slot_procs, spec, servers, tuple(render.servers(spare_plan, with_ips)))


# msrun starts every worker (and its scheduler) as `python script args`, and nothing but python.
# So each worker starts as `python -c <this> <interpreter> script args`: that python at once
# becomes `agent.py rank -- <interpreter> script args`, which records the rank's own exit status
# on its host. The scheduler (MS_ROLE=MS_SCHED) runs as is.
_MSRUN_EXEC = ("import os,sys; a=sys.argv[1:]; e=os.environ; "
               "w=e.get('MS_ROLE')!='MS_SCHED' and e.get('RANK_ID'); "
               "os.execvp(sys.executable if w else a[0], "
               "[sys.executable, e['ORCH_RUN_DIR']+'/agent.py', 'rank', '--']+a if w else a)")


def msrun_task(command: Iterable[str]) -> list[str]:
    """What msrun runs for every worker, in place of `script args`."""
    command = list(command)
    script = render.msrun_script(command)
    interp = command[0] if len(command) > len(script) else "python"  # msrun's own default
    # msrun runs `python`/`python3` given as the script as is (anything else: `python X`)
    starter = "python3" if posixpath.basename(interp).startswith("python3") else "python"
    return [starter, "-c", _MSRUN_EXEC, interp, *script]


def _with_env(cluster: Cluster, env: Mapping[str, str]) -> Cluster:
    return replace(cluster, job=replace(cluster.job, env=dict(env)))


def _launcher_path_env(cluster: Cluster, host: str) -> dict[str, str]:
    """job.env / host env PATH applies to the launcher command itself (to find mpirun/msrun)."""
    env = render.host_env(cluster, cluster.host(host))
    return {k: env[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in env}


# --------------------------------------------------------------------------- what `orch plan` shows

PLAN_RUN_ID = "<run-id>"


def launch_commands(cluster: Cluster, plan: RankPlan, *, root: bool, redact: bool = True, device_ips: Mapping[str, Mapping[int, str]] | None = None,
                    run_id: str = PLAN_RUN_ID) -> dict[str, list[dict[str, Any]]]:
    """{host name: [process record]}: exactly what each host's supervisor starts for attempt 1
    of a run (`orch up` runs these very argv lists), hosts in plan order. A record is
    {"key", "argv", "env", "cwd", "stdout"} plus "rank" for a rank the supervisor starts
    itself. With `redact`, Secret values (env, command words holding one) show as sh.MASK."""
    job = cluster.job
    roots = {h.name: root for h in plan.hosts}
    if job.launcher == "ranktable" and job.platform == "ascend" and device_ips is None:
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


def plan_files(cluster: Cluster, plan: RankPlan, *, device_ips: Mapping[str, Mapping[int, str]] | None,
               root: bool) -> dict[str, str]:
    """{file name: text} of everything `orch up` would use, as `orch plan --out DIR` writes it:
    plan.json, commands.json (secrets masked; the very processes each host's supervisor
    starts, and where the other hosts reach the launch host: what HEAD_ADDR in them stands for), hostfile (mpirun), rank_table.json (ranktable, only when device_ips is given)."""
    files = {"plan.json": json.dumps(render.plan_document(cluster, plan), indent=2) + "\n"}
    head = head_reach(cluster, plan.launch_host, plan.all_hosts)
    commands = {"launcher": plan.launcher, "run_dir": run_dir(cluster, PLAN_RUN_ID),
                "head_address": {"host": plan.launch_host.name, "addresses": list(head.addresses),
                                 "pinned": head.pinned, "in_commands": head.rendered,
                                 "means": f"the other hosts reach {plan.launch_host.name} at "
                                          f"{head.describe(plan.launch_host.name)}"},
                "hosts": launch_commands(cluster, plan, root=root, redact=True,
                                         device_ips=device_ips)}
    if plan.launcher == "mpirun":   # given to each rank by its host's supervisor, never by mpirun
        commands["secret_env"] = sh.shown_env(render.mpirun_secrets(cluster, plan))
    files["commands.json"] = json.dumps(commands, indent=2) + "\n"
    if plan.launcher == "mpirun":
        files[render.HOSTFILE] = render.hostfile(plan, by_name=cluster.slurm is not None)
    if plan.launcher == "ranktable" and device_ips is not None:
        files[render.RANK_TABLE] = render.rank_table(cluster, plan, device_ips)
    return files
