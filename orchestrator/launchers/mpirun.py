"""mpirun (pure): one mpirun on the launch host starts every rank, each under `agent.py rank`
(its pid and exit status reported to its own host's supervisor); the OpenMPI hostfile.

Secret environment variables (Job.is_secret) never appear in mpirun's argv nor on Open MPI's
wire (`-x NAME` would send the value in clear to every host's daemon): each host's supervisor
gets them in its configuration (on stdin) and `agent.py rank` hands them to the rank from a file
only the user can read (`mpirun_secrets`; docs/supervision.md)."""

from __future__ import annotations

import posixpath
from typing import Any, Mapping, Sequence

from .. import sh
from ..agent import tables
from ..agent.layout import ATTEMPT_VAR, DIR_VAR, REPLACED_VAR, RUN_VAR
from ..hostlayout import log_dir_path
from ..logins import ssh_args
from ..model import Cluster
from ..rankplan import RankPlan
from .base import ATTEMPT_DIR, Context, Launcher, Proc, host_env, interface_env, servers, visible_devices, wrapped


HOSTFILE = "hostfile"
TREE_SPAWN_HOSTS = 64  # above this many hosts mpirun's daemons would ssh to each other (tree spawn)


def hostfile_path(cluster: Cluster) -> str:
    return posixpath.join(cluster.job.workdir, HOSTFILE)


def hostfile(plan: RankPlan, by_name: bool = False) -> str:
    """OpenMPI hostfile: `ADDRESS slots=N`, one host a line, in plan order (rank 0 on the first).
    `by_name`: host names instead (in a Slurm allocation, OpenMPI accepts only its node names)."""
    return tables.hostfile(servers(plan), by_name)


def mpirun_prefix(args: Sequence[str]) -> str | None:
    """`--prefix DIR` (or --prefix=DIR) from mpirun_args: mpirun then runs DIR/bin/orted remotely."""
    args = list(args)
    for i, a in enumerate(args):
        if a == "--prefix" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--prefix="):
            return a.split("=", 1)[1]
    return None


def mpirun_exports(cluster: Cluster, plan: RankPlan, job_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every rank's environment as mpirun's launch host gives it: `job_env` (default job.env; `build`
    passes it with what orch adds), overlaid with the launch host's env and device selection
    (make_plan makes these the same on every host)."""
    h = plan.launch_host
    return {**(cluster.job.env if job_env is None else job_env), **h.env, **visible_devices(cluster, h)}


def mpirun_ssh_args(plan: RankPlan) -> list[str]:
    """mpirun's one set of ssh options for every other host (make_plan checks they agree)."""
    head = plan.launch_host
    others = [h for h in plan.hosts if h.name != head.name and h.connection == "ssh"]
    return ssh_args(head, others[0]) if others else []


def mpirun_interface(chosen: Mapping[str, tuple[str, str | None]]) -> tuple[str, dict[str, str]]:
    """{host: (interface, its IPv4 network or None)} -> (mpirun's btl/oob_tcp_if_include value,
    the variables exported to every rank). One name when every host agrees; otherwise the
    networks (OpenMPI takes CIDRs) and the names as NCCL/HCCL prefix lists (Gloo takes one name:
    left to each host's default)."""
    names = sorted({n for n, _ in chosen.values()})
    if len(names) == 1:
        return names[0], interface_env(names[0])
    nets = sorted({net for _, net in chosen.values() if net})
    joined = ",".join(names)
    return ",".join(nets) or joined, {"NCCL_SOCKET_IFNAME": joined, "HCCL_SOCKET_IFNAME": joined}


def mpirun_argv(cluster: Cluster, plan: RankPlan, *, hostfile_path: str, root: bool,
                interface: str | None = None, output_dir: str | None = None,
                pass_env: tuple[str, ...] = (), command: list[str] | None = None,
                tag: tuple[str, str] | None = None, exports: Mapping[str, str] | None = None,
                share: str | None = None) -> list[str]:
    """The one mpirun command, run on the plan's launch host from any directory.

    Ranks start in workdir (--wdir) and write workdir/log_dir/1/rank.N/stdout. Environment:
    `-x NAME=VALUE` for `exports` (default `mpirun_exports`: job.env + host env, the same on every
    host, and the device selection) but the secrets: their values reach the ranks through the
    supervisors (mpirun_secrets). `share`: the ControlPath of the launch host's open connections to
    the others (probes.mesh_shared), which mpirun's ssh uses where one is open."""
    job = cluster.job
    argv = ["mpirun", "-n", str(plan.size), "--hostfile", hostfile_path, "--wdir", job.workdir,
            "--output-filename", output_dir or log_dir_path(cluster), "--merge-stderr-to-stdout"]
    if root:
        argv.append("--allow-run-as-root")
    user_args = " ".join(job.mpirun_args)
    if "bind-to" not in user_args:  # one rank per device, each free to use every core (as horovodrun)
        argv += ["--bind-to", "none"]
    if job.on_failure == "continue":
        argv += ["-mca", "orte_abort_on_non_zero_status", "0"]
    rsh = mpirun_ssh_args(plan) + (["-o", f"ControlPath={share}"] if share else [])
    if rsh and "plm_rsh_args" not in user_args:  # mpirun's own ssh to the other hosts: the inventory's port/user
        argv += ["-mca", "plm_rsh_args", " ".join(rsh)]
    if len(plan.hosts) > TREE_SPAWN_HOSTS and "tree_spawn" not in user_args:
        argv += ["-mca", "plm_rsh_no_tree_spawn", "1"]  # every ssh from the launch host, as `orch check` tests
    if interface:
        argv += ["-mca", "btl_tcp_if_include", interface, "-mca", "oob_tcp_if_include", interface]
    for name, value in (mpirun_exports(cluster, plan) if exports is None else exports).items():
        if not job.is_secret(name):
            argv += ["-x", f"{name}={value}"]
    for name in pass_env:
        argv += ["-x", name]
    if tag is not None and not any(a == "--prefix" or "orte_launch_agent" in a for a in job.mpirun_args):
        # OpenMPI's daemon on every other host carries the tag (NAME=VALUE) in its environment too,
        # so `orch down` and the stale check find it like every other process of the run
        argv += ["-mca", "orte_launch_agent", f"env {tag[0]}={tag[1]} orted"]
    argv += list(job.mpirun_args)
    argv += list(job.command) if command is None else list(command)
    return argv


def mpirun_secrets(cluster: Cluster, plan: RankPlan, exports: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret values every rank of an mpirun job gets from its host's supervisor (`agent.py
    rank`), never through mpirun."""
    got = mpirun_exports(cluster, plan) if exports is None else exports
    return {k: v for k, v in got.items() if cluster.job.is_secret(k)}


def _path_env(cluster: Cluster, host: str) -> dict[str, str]:
    """job.env / host env PATH applies to the launcher command itself (to find mpirun)."""
    env = host_env(cluster, cluster.host(host))
    return {k: env[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in env}


class Mpirun(Launcher):
    name = "mpirun"
    needs_mesh = True
    program = "mpirun"
    tools = ("openmpi",)
    root_flag = True

    def programs(self, cluster: Cluster) -> list[tuple[str, str]]:
        # its daemon on the other hosts: under --prefix, or found by mpirun's own ssh
        prefix = mpirun_prefix(cluster.job.mpirun_args)
        return [("mpirun", "job"), ("orted", f"{prefix.rstrip('/')}/bin/orted" if prefix else "plain")]

    def _exports(self, ctx: Context) -> dict[str, str]:
        _, mpi_if_env = mpirun_interface(ctx.interfaces) if ctx.interfaces else (None, {})
        # job.env over what orch adds; the stall detector's setting over job.env
        return mpirun_exports(ctx.cluster, ctx.plan, {**mpi_if_env, **ctx.added, **ctx.cluster.job.env, **ctx.stall_env})

    def procs(self, ctx: Context) -> dict[str, list[Proc]]:
        if ctx.only:   # a spare in mpirun's job: mpirun (on the launch host) starts its ranks
            return {}
        cluster, plan, head = ctx.cluster, ctx.plan, ctx.plan.launch_host
        mca = mpirun_interface(ctx.interfaces)[0] if ctx.interfaces else None
        argv = mpirun_argv(cluster, plan, hostfile_path=hostfile_path(cluster), root=ctx.root.get(head.name, False),
                           interface=mca, output_dir=ATTEMPT_DIR, pass_env=(RUN_VAR, DIR_VAR, ATTEMPT_VAR, REPLACED_VAR),
                           command=wrapped(ctx.rdir, cluster.job.command), tag=(RUN_VAR, ctx.run_id),
                           exports=self._exports(ctx), share=ctx.share)
        return {head.name: [Proc("mpirun", tuple(argv), _path_env(cluster, head.name), cluster.job.workdir,
                                 "mpirun.log")]}

    def files(self, ctx: Context) -> dict[str, dict[str, bytes]]:
        if ctx.only:
            return {}
        return {ctx.plan.launch_host.name: {HOSTFILE: hostfile(ctx.plan, by_name=ctx.cluster.slurm is not None).encode()}}

    def secret_env(self, ctx: Context) -> dict[str, Mapping[str, str]]:
        if ctx.only:
            return {}
        secrets = mpirun_secrets(ctx.cluster, ctx.plan, self._exports(ctx))
        return {h.name: secrets for h in ctx.plan.all_hosts} if secrets else {}

    def launch_files(self, cluster: Cluster) -> dict[str, object]:
        return {"hostfile": HOSTFILE, "by_name": cluster.slurm is not None}

    def launcher_hosts(self, plan: RankPlan) -> list[str]:
        return [plan.launch_host.name]

    def plan_document(self, cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
        return {"hostfile": hostfile_path(cluster)}

    def plan_commands(self, cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
        # given to each rank by its host's supervisor, never by mpirun
        return {"secret_env": sh.shown_env(mpirun_secrets(cluster, plan))}

    def plan_files(self, cluster: Cluster, plan: RankPlan,
                   device_ips: Mapping[str, Mapping[int, str]] | None) -> dict[str, str]:
        return {HOSTFILE: hostfile(plan, by_name=cluster.slurm is not None)}
