"""The cluster as orch uses it: frozen types, no validation, no pydantic.

spec.py builds these from cluster.yaml (and checks them); runs.py stores them in a run record
and reads them back (`Cluster.to_dict` / `Cluster.from_dict`, lossless), so commands that work
from a record (`orch status`, `orch logs`, `orch down`) never import the validation layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar

from . import sh
from .errors import UsageError
from .hostsets import NodeSetParseError, expand, fold

SECRET_NAME = re.compile(r"(_TOKEN|_KEY|_SECRET)$|PASSWORD|PASSWD", re.IGNORECASE)


def _plain(value: Any) -> Any:
    """A model value as JSON holds it: tuples as lists, mapping keys as strings, Paths as text."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def _fields_dict(obj: Any) -> dict[str, Any]:
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}


def _known(cls: type, d: Mapping[str, Any], **converted: Any) -> dict[str, Any]:
    """`d`'s keys that are fields of `cls` (a record from another orch version may hold others),
    with `converted` values put back in their model types."""
    names = {f.name for f in fields(cls)}
    return {**{k: v for k, v in d.items() if k in names}, **{k: v for k, v in converted.items() if k in d}}


def _tuple(d: Mapping[str, Any], key: str) -> tuple[Any, ...] | None:
    v = d.get(key)
    return None if v is None else tuple(v)


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    user: str
    port: int = 22
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    connection: Literal["ssh", "local"] = "ssh"
    slots: int = 1
    devices: tuple[int, ...] = (0,)
    device_ips: Mapping[int, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    hostname: str | None = None          # where SSH connects, when ssh_config's HostName differs from address
    jump: tuple[Host, ...] = ()        # jump hosts, first hop first (ProxyJump / inventory `jump:`)
    proxy_command: str | None = None     # ssh_config's ProxyCommand, tokens expanded
    mpi_address: str | None = None       # how the other hosts reach this one, when not as the controller does
    keepalive: float | None = None       # ssh_config's ServerAliveInterval
    connect_timeout: float | None = None  # ssh_config's ConnectTimeout (ssh.connect_timeout, if set, wins)
    super_device_ids: Mapping[int, int] = field(default_factory=dict)  # Atlas A3: {device id: SDID}
    super_pod_id: int | None = None      # Atlas A3: the SuperPoD the host is in (rank table 1.2)
    spare: bool = False                  # gets no ranks; takes a lost host's place (plan.RankPlan.spares)

    @property
    def ssh_address(self) -> str:
        """Where the controller's SSH connection goes (through the jump hosts, if any)."""
        return self.hostname or self.address

    @property
    def cluster_address(self) -> str:
        """How the cluster's own hosts reach this one: hostfiles, rank tables, MASTER_ADDR."""
        return self.mpi_address or self.hostname or self.address

    @property
    def target(self) -> str:
        return f"{self.user}@{self.ssh_address}" + (f":{self.port}" if self.port != 22 else "")

    @property
    def route(self) -> str:
        """How the controller reaches the host: user@hostname[:port], and through what."""
        if self.jump:
            return f"{self.target} via {' -> '.join(j.target for j in self.jump)}"
        if self.proxy_command:
            return f"{self.target} via ProxyCommand {self.proxy_command}"
        return self.target

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, lossless: `Host.from_dict(h.to_dict()) == h`."""
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Host:
        return cls(**_known(cls, d, devices=_tuple(d, "devices"),
                            device_ips={int(k): v for k, v in (d.get("device_ips") or {}).items()},
                            env=dict(d.get("env") or {}), jump=tuple(cls.from_dict(j) for j in d.get("jump") or ()),
                            super_device_ids={int(k): int(v) for k, v in (d.get("super_device_ids") or {}).items()}))


@dataclass(frozen=True)
class SshSettings:
    connect_timeout: float = 10
    command_timeout: float = 120
    fanout: int = 64
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    retries: int = 3
    config_file: str | None = "~/.ssh/config"   # None: `none`, no ssh_config read
    jump_fanout: int = 10       # new connections opened through one jump host at once

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SshSettings:
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class Job:
    workdir: str
    command: tuple[str, ...]
    launcher: Literal["mpirun", "ranktable", "msrun", "torchrun"] = "mpirun"
    platform: Literal["ascend", "gpu", "cpu"] = "cpu"
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: tuple[str, ...] = ()
    sync: tuple[str, ...] = ()
    sync_exclude: tuple[str, ...] = ()
    sync_via: Literal["controller", "launch-host"] = "controller"  # who sends the code to the hosts (sync.py)
    log_dir: str = "log_output"
    timeout: float | None = None
    on_failure: Literal["stop", "continue"] = "stop"
    mpirun_args: tuple[str, ...] = ()
    rank_table_version: Literal["1.0", "1.2", "legacy"] = "1.0"
    master_port: int = 8118
    restarts: int = 0
    restart_delay: float = 0.0
    stall_timeout: float | None = None
    interface: str | None = None   # NIC for MPI/NCCL/HCCL/Gloo traffic: a name or "auto"
    rank_dirs: bool = False        # each rank starts in workdir/rank_<N>/
    hccl_connect_timeout: int | None = None  # job.hccl: None = scaled to the cluster (hccl.hccl_env)
    hccl_exec_timeout: int | None = None
    metrics: Mapping[str, str] = field(default_factory=dict)   # name -> regex with one group (agent/metrics.py)
    collect: tuple[str, ...] = ()  # workdir paths (globs) brought back after the run (collect.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", sh.mark(self.env, self.is_secret))

    def is_secret(self, name: str) -> bool:
        return name in self.secret_env or bool(SECRET_NAME.search(name))

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Job:
        return cls(**_known(cls, d, **{k: _tuple(d, k) for k in _JOB_TUPLES}, env=dict(d.get("env") or {}),
                            metrics=dict(d.get("metrics") or {})))


_JOB_TUPLES = ("command", "secret_env", "sync", "sync_exclude", "mpirun_args", "collect")


@dataclass(frozen=True)
class Checks:
    versions: tuple[str, ...] | None = None
    skip: tuple[str, ...] = ()
    min_free_gib: float = 1.0
    clock_skew: float = 5.0

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Checks:
        return cls(**_known(cls, d, versions=_tuple(d, "versions"), skip=_tuple(d, "skip")))


@dataclass(frozen=True)
class Slurm:
    """`inventory.slurm`: hosts come from a Slurm allocation of `nodes` nodes; each allocated
    node becomes a host with the inventory's defaults (`template`, nameless)."""
    nodes: int
    template: Host
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    gres: str | None = None
    exclusive: bool = False
    extra: tuple[str, ...] = ()
    login: str | None = None   # an ssh host where Slurm commands run; None: this machine
    conf: str | None = None    # SLURM_CONF for those commands; None: Slurm's own default
    login_host: Host | None = None  # `login` as SSH reaches it (ssh_config, jump hosts), port 22 by default
    spares: int = 0            # more nodes requested up front: the allocation's last ones are spares

    @property
    def allocated(self) -> int:
        """The nodes asked of Slurm: the job's and the spares."""
        return self.nodes + self.spares

    def to_dict(self) -> dict[str, Any]:
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Slurm:
        login = d.get("login_host")
        return cls(**_known(cls, d, template=Host.from_dict(d["template"]), extra=_tuple(d, "extra"),
                            login_host=Host.from_dict(login) if login else None))


_MaybeHost = TypeVar("_MaybeHost", bound="Host | None")


@dataclass(frozen=True)
class Cluster:
    name: str
    path: Path  # the cluster file (absolute)
    hosts: tuple[Host, ...]
    job: Job
    ssh: SshSettings = SshSettings()
    checks: Checks = Checks()
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    slurm: Slurm | None = None

    def __post_init__(self) -> None:
        """Secret values become sh.Secret here, the first place that knows both a job's secret
        names and every host's env: whatever prints or records them (sh.shown) masks them by type.
        A word of job.command holding a secret value (the user's own text) is found by search."""
        job = self.job

        def marked(h: _MaybeHost) -> _MaybeHost:
            if h is None or all(isinstance(v, sh.Secret) or not job.is_secret(k) for k, v in h.env.items()):
                return h
            return replace(h, env=sh.mark(h.env, job.is_secret))

        hosts = tuple(marked(h) for h in self.hosts)
        secrets = [v for env in (job.env, *(h.env for h in hosts)) for v in env.values() if isinstance(v, sh.Secret)]
        command = sh.mark_words(job.command, secrets) if secrets else job.command
        object.__setattr__(self, "hosts", hosts)
        sl = self.slurm  # the template's env reaches every allocated node; the login host's, sbatch
        if sl is not None and (marked(sl.template) is not sl.template or marked(sl.login_host) is not sl.login_host):
            object.__setattr__(self, "slurm", replace(sl, template=marked(sl.template), login_host=marked(sl.login_host)))
        if any(a is not b for a, b in zip(command, job.command)):
            object.__setattr__(self, "job", replace(job, command=command))

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, lossless: `Cluster.from_dict(c.to_dict()) == c`."""
        return _fields_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        slurm = d.get("slurm")
        return cls(**_known(cls, d, path=Path(d["path"]), hosts=tuple(Host.from_dict(h) for h in d.get("hosts", ())),
                            job=Job.from_dict(d["job"]), ssh=SshSettings.from_dict(d.get("ssh") or {}),
                            checks=Checks.from_dict(d.get("checks") or {}),
                            groups={g: tuple(m) for g, m in (d.get("groups") or {}).items()},
                            slurm=Slurm.from_dict(slurm) if slurm else None))

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def select(self, pattern: str | None) -> Cluster:
        """Subset by `--hosts`: names, addresses, ranges (node[01-04]) or group names, comma-separated."""
        if not pattern:
            return self
        if self.slurm is not None and not self.hosts:
            raise UsageError(f"--hosts {pattern!r}: a Slurm inventory lists no hosts; Slurm picks the nodes",
                             hint="narrow them with inventory.slurm (nodes, partition, constraint, extra: "
                                  "[--nodelist=...])")

        if any(pattern == h.name for h in self.hosts):  # an exact name, whatever it holds
            return replace(self, hosts=tuple(h for h in self.hosts if h.name == pattern))
        wanted: set[str] = set()
        try:
            for part in expand(pattern):
                if part in self.groups:
                    wanted.update(self.groups[part])
                else:
                    wanted.add(part)
        except NodeSetParseError as exc:
            raise UsageError(f"--hosts {pattern!r}: {exc}") from None
        chosen = tuple(h for h in self.hosts if h.name in wanted or h.address in wanted)
        known = {h.name for h in chosen} | {h.address for h in chosen}
        for g in self.groups:
            if g in wanted:
                known.update(self.groups[g])
                known.add(g)
        unknown = sorted(w for w in wanted if w not in known and w not in self.groups)
        if unknown:
            raise UsageError(f"--hosts {pattern!r}: no host or group named {', '.join(unknown)}",
                             hint=f"hosts are: {fold(h.name for h in self.hosts)}")
        return replace(self, hosts=chosen)
