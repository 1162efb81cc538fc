"""What every launcher shares (pure): the processes a host's supervisor starts (`Proc`), a whole
launch (`Launch`), what the head needs to put a spare in a lost host's place (`Spares`), where the
other hosts reach the launch host (`HeadReach`), the inputs one launch is built from (`Context`)
and the interface each launcher implements (`Launcher`)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..agent import tables
from ..agent.layout import AGENT, HEAD_ADDR_TOKEN
from ..errors import PlanError
from ..agent.layout import ATTEMPT_DIR_TOKEN as ATTEMPT_DIR
from ..hostlayout import PY
from ..model import Cluster, Host
from ..rankplan import RankPlan, visible_devices_var

# In an argv or env value: the launch host's address as the other hosts reached it (torchrun's and
# msrun's master address, MASTER_ADDR), when the cluster file does not pin one (HeadReach.pinned);
# each host's supervisor puts in the address its connection to the head's supervisor worked on.
HEAD_ADDR = HEAD_ADDR_TOKEN

__all__ = ["ATTEMPT_DIR", "HEAD_ADDR", "Context", "HeadReach", "Launch", "Launcher", "PerHost", "Proc", "Spares", "head_reach",
           "host_env", "interface_env", "node_env", "servers", "visible_devices", "wrapped"]


@dataclass(frozen=True)
class Proc:
    """One process a host's supervisor starts."""

    key: str                        # rank.N | mpirun | msrun.<host> | torchrun.<host>
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
class Spares:
    """What the run's head needs to put a spare in a lost host's place on the cluster, with the
    controller detached: which hosts each spare may replace and what it then runs (rendered by
    `build` for the plan with that one swap: plan.replaced), and the facts the launch files
    that name hosts are rendered from there (agent.tables, the same code `orch plan` uses)."""

    slot_procs: Mapping[str, Mapping[str, tuple[Proc, ...]]]   # spare -> {host it replaces: its processes}
    tables: Mapping[str, object]                               # agent.tables.render's spec
    servers: tuple[dict[str, Any], ...]                        # the planned hosts, plan order
    spare_servers: tuple[dict[str, Any], ...]                  # the spares' facts (their ranks: none)

    def fits(self) -> dict[str, list[str]]:
        return {s: list(slots) for s, slots in self.slot_procs.items()}


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
class Context:
    """The inputs of one launch, as `build` derived them for every launcher alike."""

    cluster: Cluster
    plan: RankPlan
    run_id: str
    root: Mapping[str, bool]                            # host -> the launch user is root there
    device_ips: Mapping[str, Mapping[int, str]] | None
    interfaces: Mapping[str, tuple[str, str | None]]    # host -> (job.interface there, its network)
    aarch64: bool
    master: str                                         # the launch host's address in commands (HeadReach.rendered)
    rdir: str                                           # the run's directory on the hosts
    added: Mapping[str, str]                            # what orch adds to every rank's environment
    host_added: Mapping[str, Mapping[str, str]]         # host -> interface pinning + `added`
    stall_env: Mapping[str, str]                        # for the stall detector's stack dumps
    only: str | None                                    # one spare in one host's place: that host alone
    share: str | None = None                            # ControlPath of the ssh mpirun may share (probes.mesh_shared)

    def hosts(self) -> list[Host]:
        """The plan's hosts whose processes this launch builds (`only`: that one)."""
        return [self.plan.host(self.only)] if self.only else list(self.plan.hosts)


class Launcher:
    """One way to start a job's ranks. Subclasses set the facts and build the processes; nothing
    outside the registry (`launchers.LAUNCHERS`) asks a launcher's name what it needs."""

    name = ""
    needs_mesh = False        # the launch host logs in to the others (mpirun's daemons)
    uses_master_port = False  # the launch host listens on job.master_port (a rendezvous)
    program: str | None = None  # the command every host needs on PATH
    tools: tuple[str, ...] = ()  # what `orch check` compares across hosts for it (checks.versions' names)
    root_flag = False         # run as root, it needs a flag orch adds (mpirun's --allow-run-as-root)

    def procs(self, ctx: Context) -> dict[str, list[Proc]]:
        raise NotImplementedError

    def files(self, ctx: Context) -> dict[str, dict[str, bytes]]:
        """host -> {name in workdir: bytes} (hostfile, rank table)."""
        return {}

    def rendered_names(self, cluster: Cluster) -> tuple[str, ...]:
        """The names in workdir `files` may give, known before the plan's facts (`orch up`'s probe
        lists them on every host: sync then needs no round trip of its own): the files of its
        launch_files spec."""
        spec = self.launch_files(cluster)
        return tuple(str(spec[k]) for k in ("hostfile", "rank_table") if k in spec)

    def secret_env(self, ctx: Context) -> dict[str, Mapping[str, str]]:
        """host -> secrets `agent.py rank` hands each rank there (only where the launcher's own
        wire would carry them in clear)."""
        return {}

    def launch_files(self, cluster: Cluster) -> dict[str, object]:
        """agent.tables.render's spec: the launch files that name hosts (what the head renders
        again when a spare takes a host's place)."""
        return {}

    def programs(self, cluster: Cluster) -> list[tuple[str, str]]:
        """(label, how `orch check` finds it) for each executable of its own every host needs:
        "job" (the ranks' PATH), "plain" (the non-interactive ssh PATH) or an absolute path."""
        return [(self.program, "job")] if self.program else []

    def launcher_hosts(self, plan: RankPlan) -> list[str]:
        """The hosts where the launcher itself writes a log of its own."""
        return []

    def plan_document(self, cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
        """What plan.json adds for this launcher (its files' paths)."""
        return {}

    def plan_commands(self, cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
        """What commands.json (`orch plan --out`) adds for this launcher."""
        return {}

    def plan_files(self, cluster: Cluster, plan: RankPlan,
                   device_ips: Mapping[str, Mapping[int, str]] | None) -> dict[str, str]:
        """The launcher's own files as `orch plan --out` writes them: {name: text}."""
        return {}

    def needs_device_ips(self, cluster: Cluster) -> bool:
        """Does the launch need every device's IP (an HCCL rank table)?"""
        return False


class PerHost(Launcher):
    """A launcher started once per host (msrun, torchrun): node rank = the host's place in the
    plan, master = the launch host; its log beside the attempt's rank logs."""

    uses_master_port = True
    env: Mapping[str, str] = {}   # what it adds to its own environment

    def argv(self, ctx: Context, host: str) -> list[str]:
        raise NotImplementedError

    def procs(self, ctx: Context) -> dict[str, list[Proc]]:
        cluster, plan = ctx.cluster, ctx.plan
        return {h.name: [Proc(f"{self.name}.{h.name}", tuple(self.argv(ctx, h.name)),
                              {**ctx.host_added[h.name], **node_env(cluster, plan, h.name), **ctx.stall_env, **self.env},
                              cluster.job.workdir, f"{self.name}.log")]
                for h in ctx.hosts()}

    def launcher_hosts(self, plan: RankPlan) -> list[str]:
        return [h.name for h in plan.hosts]


def host_env(cluster: Cluster, host: Host) -> dict[str, str]:
    """job.env overlaid with the host's env (the host wins)."""
    return {**cluster.job.env, **host.env}


def visible_devices(cluster: Cluster, host: Host) -> dict[str, str]:
    """{CUDA_/ASCEND_RT_VISIBLE_DEVICES: ids} when the host uses devices other than 0..slots-1."""
    if cluster.job.platform not in ("gpu", "ascend") or host.devices == tuple(range(len(host.devices))):
        return {}
    return {visible_devices_var(cluster.job.platform): ",".join(map(str, host.devices))}


def node_env(cluster: Cluster, plan: RankPlan, host_name: str) -> dict[str, str]:
    """The environment of one host's launcher (msrun, torchrun): job.env, host env, device selection."""
    host = plan.host(host_name)
    return {**host_env(cluster, host), **visible_devices(cluster, host)}


def wrapped(rdir: str, command: Iterable[str]) -> list[str]:
    """A rank's command under `agent.py rank` (mpirun, msrun and torchrun start ranks, not the supervisor)."""
    return [*PY, posixpath.join(rdir, AGENT), "rank", "--", *command]


def interface_env(name: str) -> dict[str, str]:
    """The variables that pin NCCL, HCCL and Gloo traffic to a NIC (job.interface)."""
    return {"NCCL_SOCKET_IFNAME": name, "HCCL_SOCKET_IFNAME": name, "GLOO_SOCKET_IFNAME": name}


def servers(plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]] | None = None) -> list[tables.Server]:
    """The plan's hosts as the launch files' renderer takes them (agent.tables), in plan order;
    with `device_ips`, every device must have one (else a PlanError naming the host)."""
    return [tables.server(h.name, h.cluster_address, h.slots, [(r.rank, r.device_id) for r in plan.by_host(h.name)],
                          _ips(device_ips, h) if device_ips is not None else {}, h.super_device_ids, h.super_pod_id)
            for h in plan.hosts]


def _ips(device_ips: Mapping[str, Mapping[int, str]], h: Host) -> Mapping[int, str]:
    ips = device_ips.get(h.name, {})
    missing = [d for d in h.devices if d not in ips]
    if missing:
        raise PlanError(f"host {h.name}: no device IP for devices {missing}",
                        hint="get them with plan.device_ips_for (inventory device_ips or /etc/hccn.conf)")
    return ips
