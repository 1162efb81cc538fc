"""cluster.yaml and inventories -> the frozen, validated types of model.py.

Two passes: pydantic checks the shape of the raw data (unknown keys, types),
then semantic rules (duplicates, devices vs slots, paths) are checked on the
expanded hosts. Every problem in both passes is collected and reported at once,
each with its file, line and field path.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
import shlex
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Mapping, NamedTuple

from ClusterShell.NodeSet import NodeSetParseError
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, field_validator

from .checks.names import KNOWN_CHECKS  # the names only: no check is imported
from .errors import Location, SpecError
from .hostsets import expand, expand_names
# the model's types, for callers that load a cluster file and build on it (tests, mostly)
from .model import Checks, Cluster, Host, Job, Slurm, SshSettings
from .yamlsrc import Source, load_yaml
from .collect import path_problem
from .agent import metrics
from .transport.sshconfig import (DEFAULT_PATH, MAX_HOPS, SshConfig, SshConfigError, hops_of, local_user, parse_hops,
                                   resolve)


KNOWN_TOOLS = ("openmpi", "nccl", "python", "mindspore", "cann", "cuda-driver", "torch")
MAX_SLOTS = 1024  # ranks on one host: above any real machine, and a typo costs no memory
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MPIRUN_UNSAFE = frozenset('$`"\\!')  # special inside double quotes (sh, csh)
USER_NAME = re.compile(r"^[A-Za-z0-9_.@][A-Za-z0-9_.@$-]{0,63}$")  # what ssh -l and mpirun's plm_rsh_args take

# --------------------------------------------------------------------------- raw shapes


class _Raw(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


EnvValue = str | StrictInt | float


def _env_check(value: Mapping[str, Any] | None) -> dict[str, str] | None:
    if not isinstance(value, Mapping):
        return value  # not a mapping: pydantic reports the type error with its location
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not ENV_NAME.match(k):
            raise ValueError(f"environment variable name {k!r} is not valid (letters, digits, _; not starting with a digit)")
        if isinstance(v, bool):
            raise ValueError(f"value of {k} must be a string or a number (quote it: {k}: \"{v}\")")
        if v is None or isinstance(v, (list, dict)):  # never echoed: it may be a secret
            what = "empty" if v is None else f"a {type(v).__name__}"
            raise ValueError(f"value of {k} must be a string or a number, not {what} (quote it)")
        out[k] = str(v)
    return out


def _within(lo: float, hi: float, message: str):
    """A pydantic field check: the value (when given) lies in [lo, hi], else `message`."""
    def check(cls, v):
        if v is not None and not lo <= v <= hi:
            raise ValueError(message)
        return v
    return classmethod(check)


class RawHostKeys(_Raw):
    user: str | None = None
    port: int | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    connection: Literal["ssh", "local"] | None = None
    slots: int | None = None
    devices: list[int] | None = None
    device_ips: dict[int, str] | None = None
    env: dict[str, EnvValue] | None = None
    jump: str | list[str] | None = None
    mpi_address: str | None = None
    super_device_ids: dict[int, int] | None = None   # Atlas A3 (rank table 1.2): {device id: SDID}
    super_pod_id: int | None = None                  # Atlas A3 (rank table 1.2)

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: _env_check(v)))

    _port = field_validator("port")(_within(1, 65535, "port must be between 1 and 65535"))

    @field_validator("mpi_address")
    @classmethod
    def _mpi_address(cls, v):
        if v is not None and (not v.strip() or v.startswith("-") or
                              any(c.isspace() or c in "\0'\"\\$`;&|<>()" for c in v)):
            raise ValueError(f"mpi_address {v!r} is not a host name or IP address")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v):
        if v is not None and not USER_NAME.match(v):
            raise ValueError(f"user {v!r} is not a login name (letters, digits, . _ - @, not starting with -)")
        return v

    @field_validator("slots")
    @classmethod
    def _slots(cls, v):
        if v is not None and v < 1:
            raise ValueError("slots must be at least 1")
        if v is not None and v > MAX_SLOTS:
            raise ValueError(f"slots {v} is more than {MAX_SLOTS} ranks on one host")
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v):
        if v is not None and any(d < 0 for d in v):
            raise ValueError("device ids are non-negative integers")
        return v

    @field_validator("super_device_ids")
    @classmethod
    def _super_device_ids(cls, v):
        for d, sdid in (v or {}).items():
            if d < 0:
                raise ValueError("super_device_ids: device ids are non-negative integers")
            if not 0 <= sdid <= 2 ** 32 - 1:
                raise ValueError(f"super_device_ids: {sdid} (device {d}) is not an SDID, an unsigned 32-bit "
                                 "integer as `npu-smi info -t spod-info` prints it")
        return v

    _super_pod = field_validator("super_pod_id")(_within(0, 2 ** 32 - 1, "super_pod_id is a non-negative integer "
                                                                          "(npu-smi's Super Pod ID)"))


class RawHost(RawHostKeys):
    address: str
    name: str | None = None
    spare: bool = False   # a spare host: no ranks; it takes a lost host's place (docs/spares.md)


SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(UNLIMITED|INFINITE)$")


class RawSlurm(_Raw):
    nodes: StrictInt
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    gres: str | None = None
    exclusive: bool = False
    extra: list[str] = []
    login: str | None = None
    conf: str | None = None
    spares: StrictInt = 0   # more nodes, requested up front, that run no ranks until a node is lost

    _spares = field_validator("spares")(_within(0, 1 << 20, "spares must be 0 or more"))

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v):
        if v < 1:
            raise ValueError("nodes must be at least 1")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v):
        if v is not None and not SLURM_TIME.match(v):
            raise ValueError(f"time {v!r} is not a Slurm time limit: use \"HH:MM:SS\", \"MM\" or \"D-HH:MM:SS\"")
        return v

    @field_validator("partition", "account", "qos", "constraint", "gres", "login")
    @classmethod
    def _word(cls, v):
        if v is not None and (not v.strip() or any(c in v for c in "\n\0")):
            raise ValueError("must be a non-empty single-line string")
        return v


class RawInventory(_Raw):
    defaults: RawHostKeys = RawHostKeys()
    hosts: list[RawHost] | None = None
    slurm: RawSlurm | None = None
    groups: dict[str, list[str]] = {}
    spares: int = 0   # the last N hosts of `hosts` are spares (as `spare: true` on each)

    _spares = field_validator("spares")(_within(0, 1 << 20, "spares must be 0 or more"))

    @field_validator("hosts")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("the inventory lists no hosts")
        return v


class RawSsh(_Raw):
    connect_timeout: float = 10
    command_timeout: float = 120
    fanout: int = 64
    host_key_policy: Literal["strict", "accept-new"] = "strict"
    retries: int = 3
    config_file: str = "~/.ssh/config"
    jump_fanout: int = 10

    @field_validator("connect_timeout", "command_timeout")
    @classmethod
    def _pos(cls, v):
        if v <= 0:
            raise ValueError("must be > 0 seconds")
        return v

    @field_validator("fanout", "retries", "jump_fanout")
    @classmethod
    def _atleast1(cls, v):
        if v < 1:
            raise ValueError("must be at least 1")
        return v


class RawRankTable(_Raw):
    version: Literal["1.0", "1.2", "legacy"] = "1.0"

    # YAML reads an unquoted `version: 1.2` as a number
    _version = field_validator("version", mode="before")(
        classmethod(lambda cls, v: str(v) if isinstance(v, float) else v))


class RawHccl(_Raw):
    connect_timeout: int | None = None
    exec_timeout: int | None = None

    _connect = field_validator("connect_timeout")(_within(120, 7200, "HCCL accepts a connect timeout of 120 to "
                                                                      "7200 seconds"))
    _exec = field_validator("exec_timeout")(_within(1, 17340, "HCCL accepts an exec timeout of 1 to 17340 seconds"))


class RawJob(_Raw):
    launcher: Literal["mpirun", "ranktable", "msrun", "torchrun"] = "mpirun"
    platform: Literal["ascend", "gpu", "cpu"] = "cpu"
    workdir: str
    command: str | list[str]
    env: dict[str, EnvValue] = {}
    secret_env: list[str] = []
    sync: list[str] = []
    sync_exclude: list[str] = []
    sync_via: Literal["controller", "launch-host"] | None = None
    log_dir: str = "log_output"
    timeout: float | None = None
    on_failure: Literal["stop", "continue"] = "stop"
    mpirun_args: list[str] = []
    rank_table: RawRankTable = RawRankTable()
    master_port: int = 8118
    restarts: int = 0
    restart_delay: float = 0.0
    stall_timeout: float | None = None
    interface: str | None = None
    rank_dirs: bool = False
    hccl: RawHccl = RawHccl()
    metrics: dict[str, str] = {}
    collect: list[str] = []

    _env = field_validator("env", mode="before")(classmethod(lambda cls, v: _env_check(v)))

    @field_validator("interface")
    @classmethod
    def _interface(cls, v):
        if v is not None and v != "auto" and not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", v):
            raise ValueError(f"interface {v!r} is not a network interface name (e.g. eth0, ib0) or 'auto'")
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v):
        if v is not None and v <= 0:
            raise ValueError("timeout must be > 0 seconds")
        return v

    @field_validator("stall_timeout")
    @classmethod
    def _stall(cls, v):
        if v is not None and v <= 0:
            raise ValueError("stall_timeout must be > 0 seconds (leave it out to turn stall detection off)")
        return v

    _restarts = field_validator("restarts")(_within(0, 1000, "restarts must be between 0 and 1000"))
    _delay = field_validator("restart_delay")(_within(0, 86400, "restart_delay must be between 0 and 86400 seconds"))
    _port = field_validator("master_port")(_within(1, 65535, "master_port must be between 1 and 65535"))


class RawChecks(_Raw):
    versions: list[Literal[KNOWN_TOOLS]] | None = None  # type: ignore[valid-type]  # pydantic reads it, mypy cannot
    skip: list[Literal[KNOWN_CHECKS]] = []  # type: ignore[valid-type]  # a Literal of a tuple of names
    min_free_gib: float = 1.0
    clock_skew: float = 5.0


class RawCluster(_Raw):
    name: str | None = None
    inventory: str | dict[str, Any]
    ssh: RawSsh = RawSsh()
    job: RawJob
    checks: RawChecks = RawChecks()


# --------------------------------------------------------------------------- loading


class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[Location, str]] = []

    def add(self, loc: Location, msg: str) -> None:
        self.items.append((loc, msg))

    def pydantic(self, exc: ValidationError, src: Source, offset: tuple = (), keys: dict | None = None) -> None:
        """`keys`: the models of the validated mapping and of its parts, by path (default: the
        cluster file's), for the keys an unknown one is compared with."""
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _is_union_tag(p)))
            if err["type"] == "extra_forbidden" and loc[-1:] != err["loc"][-1:]:  # a user's key like "dict["
                loc += err["loc"][-1:]
            path = offset + loc
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = f"unknown key {path[-1]!r}" + _suggest(loc, _KNOWN_KEYS if keys is None else keys)
            elif err["type"] == "missing":
                msg = f"missing required key {path[-1]!r}" + (" (or give one with -i/--inventory)"
                                                               if path == ("inventory",) else "")
            elif msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            elif err["type"] == "literal_error" and isinstance(err.get("input"), str):
                import difflib

                allowed = [str(x).strip("'") for x in re.findall(r"'[^']*'", msg)]
                close = difflib.get_close_matches(err["input"], allowed, n=1, cutoff=0.75)
                msg = f"{err['input']!r}: {msg[0].lower()}{msg[1:]}" + (f" (did you mean {close[0]!r}?)" if close else "")
            self.add(src.loc(path), msg)

    def raise_if_any(self) -> None:
        if self.items:
            raise SpecError(self.items)


def _is_union_tag(p: str) -> bool:
    return p in {"str", "int", "float", "list[str]", "dict[str,any]", "constrained-int"} or p.startswith(
        ("list[", "dict[", "literal[", "function-"))


_KNOWN_KEYS: dict[tuple[str, ...], type[BaseModel]] = {
    (): RawCluster, ("ssh",): RawSsh, ("job",): RawJob, ("checks",): RawChecks,
    ("job", "rank_table"): RawRankTable, ("job", "hccl"): RawHccl,
}
_INVENTORY_KEYS = {(): RawInventory, ("defaults",): RawHostKeys, ("slurm",): RawSlurm}


def _suggest(path: tuple, known: dict) -> str:
    """`path`: the unknown key's, inside the mapping whose models `known` lists by path."""
    import difflib

    key = str(path[-1])
    parent = tuple(p for p in path[:-1] if not isinstance(p, int))
    model = known.get(parent)
    if model is None:
        model = RawHost if parent and parent[-1] in ("hosts", "defaults") else None
    if model is None:
        return ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; allowed: {', '.join(model.model_fields)}"


INVENTORY_GIVEN = "the inventory given (-i/--inventory, ORCH_INVENTORY)"


def _read(path: Path, what: str, loc: Location | None) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if loc is None:   # the file itself: its path is the location
            raise SpecError([(Location(str(path)), f"no such {what}")],
                            hint="is the path right? `orch COMMAND FILE` names it (cluster.yaml in this directory "
                                 "when none is named)") from None
        raise SpecError([(loc, f"{what} {path} does not exist")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([(loc or Location(str(path)), f"cannot read {what} {path}: {exc}")]) from None


def load_cluster(path: str | os.PathLike[str], inventory: str | os.PathLike[str] | None = None) -> Cluster:
    """Parse and validate a cluster file; `inventory` (a path, relative to the current directory)
    replaces the file's own `inventory:` (Ansible's -i). Raises SpecError listing every problem."""
    path = Path(path).expanduser().absolute()
    text = _read(path, "cluster file", None)
    data, src = load_yaml(text, str(path))
    if inventory is not None and isinstance(data, dict):
        data = {**data, "inventory": str(Path(inventory).expanduser().absolute())}
    # a problem reading it is said of where it was given, not of the file's `inventory:` line
    return parse_cluster(data, src, path, Location(INVENTORY_GIVEN) if inventory is not None else None)


def parse_cluster(data: Any, src: Source, path: Path, inventory_at: Location | None = None) -> Cluster:
    problems = _Problems()
    if not isinstance(data, dict):
        raise SpecError([(Location(src.file, src.line_of(())), "the cluster file must be a mapping with "
                          "at least 'inventory:' and 'job:'")])
    raw: RawCluster | None
    try:
        raw = RawCluster.model_validate(data)
    except ValidationError as exc:
        problems.pydantic(exc, src)
        raw = _without(data, exc)   # the job's own checks then run on the rest: all problems at once

    # The inventory: inline (same file) or a path relative to the cluster file.
    inv_data, inv_src, inv_base = data.get("inventory"), src, path.parent
    inv_prefix: tuple = ("inventory",)
    if isinstance(inv_data, str):
        inv_path = (path.parent / Path(inv_data).expanduser()).absolute()
        try:
            inv_text = _read(inv_path, "inventory file", inventory_at or src.loc(("inventory",)))
        except SpecError as exc:   # said with the cluster file's own problems
            problems.items += exc.problems
            inv_data = None
        else:
            inv_data, inv_src = load_yaml(inv_text, str(inv_path))
            inv_base, inv_prefix = inv_path.parent, ()
    hosts: tuple[Host, ...] = ()
    groups: dict[str, tuple[str, ...]] = {}
    slurm: Slurm | None = None
    ssh_config = _ssh_config(raw, src, path.parent, problems)
    if isinstance(inv_data, dict):
        hosts, groups, slurm = _parse_inventory(inv_data, inv_src, inv_prefix, inv_base, problems, ssh_config)
    elif inv_data is not None and not (raw is None and isinstance(inv_data, (str, dict))):
        problems.add(inv_src.loc(inv_prefix), "the inventory must be a mapping with 'hosts:' (or 'slurm:')")

    job = None
    if raw is not None:
        job = _resolve_job(raw.job, src, problems, slurm=slurm is not None)
    problems.raise_if_any()
    assert raw is not None and job is not None
    ssh = SshSettings(**{**raw.ssh.model_dump(), "config_file": ssh_config.config.path if ssh_config else None})
    checks = Checks(versions=tuple(raw.checks.versions) if raw.checks.versions is not None else None,
                    skip=tuple(raw.checks.skip), min_free_gib=raw.checks.min_free_gib,
                    clock_skew=raw.checks.clock_skew)
    return Cluster(name=raw.name or path.stem, path=path, hosts=hosts, job=job, ssh=ssh,
                   checks=checks, groups=groups, slurm=slurm)


def _without(data: dict, exc: ValidationError) -> RawCluster | None:
    """The cluster file less the keys `exc` found wrong (each already a problem), validated again,
    so that the job's own checks see the rest. None when they may not run (the job's launcher or
    platform was wrong: they depend on them) or it still fails (a required key missing, a wrong
    one in a list)."""
    pruned = copy.deepcopy(data)
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _is_union_tag(p)))
        if not loc or loc[0] == "inventory" or any(not isinstance(p, str) for p in loc):
            return None
        parent: Any = pruned
        for p in loc[:-1]:
            parent = parent.get(p) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or loc[-1] not in parent:
            return None
        del parent[loc[-1]]
        if loc[:1] == ("job",) and loc[1:2] in (("launcher",), ("platform",)):
            return None
    try:
        return RawCluster.model_validate(pruned)
    except ValidationError:
        return None


SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc",
               "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/tmp", "/var/log",
               "/var/lib")
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys",
                "/usr/bin", "/usr/lib", "/usr/sbin", "/usr/share", "/usr/include")


def _system_dir(workdir: str) -> bool:
    """A workdir orch must never write into: a system directory itself, or anything below the
    ones the system owns whole (/etc, /proc, /usr/lib...)."""
    p = posixpath.normpath(workdir)
    return p in SYSTEM_DIRS or any(p.startswith(t + "/") for t in SYSTEM_TREES)


def _resolve_job(rj: RawJob, src: Source, problems: _Problems, *, slurm: bool = False) -> Job | None:
    if not PurePosixPath(rj.workdir).is_absolute():
        problems.add(src.loc(("job", "workdir")), f"workdir {rj.workdir!r} must be an absolute path (e.g. /data/job)")
    if "\0" in rj.workdir or "\n" in rj.workdir:
        problems.add(src.loc(("job", "workdir")), "workdir must not contain NUL or newline characters")
    elif PurePosixPath(rj.workdir).is_absolute() and _system_dir(rj.workdir):
        problems.add(src.loc(("job", "workdir")), f"workdir {rj.workdir!r} is a system directory: orch writes "
                     "hostfiles, rank tables and logs into the workdir; use a directory of the job's own "
                     "(e.g. /data/job or ~/job as an absolute path)")
    ld = PurePosixPath(rj.log_dir)
    if ld.is_absolute() or ".." in ld.parts or not rj.log_dir.strip():
        problems.add(src.loc(("job", "log_dir")), f"log_dir {rj.log_dir!r} must be a relative path inside workdir")
    elif "\0" in rj.log_dir or "\n" in rj.log_dir:
        problems.add(src.loc(("job", "log_dir")), "log_dir must not contain NUL or newline characters")
    if rj.launcher == "mpirun":
        # mpirun hands its output directory (workdir/log_dir) to every other host's shell inside
        # double quotes (`orted ... -mca orte_output_filename "..."` over ssh): these characters
        # would be expanded or executed there, so they are refused rather than passed on.
        for key, value in (("workdir", rj.workdir), ("log_dir", rj.log_dir)):
            bad = sorted({c for c in value if c in MPIRUN_UNSAFE})
            if bad:
                problems.add(src.loc(("job", key)), f"{key} {value!r} contains {' '.join(bad)}: mpirun passes "
                             f"it to a shell on the other hosts inside double quotes, where {' '.join(bad)} would "
                             "be expanded (or run); use a path without them, or launcher: ranktable")
    if isinstance(rj.command, str):
        try:
            command = tuple(shlex.split(rj.command))
        except ValueError as exc:
            problems.add(src.loc(("job", "command")), f"cannot split command: {exc}; "
                         "check the quotes, or give the command as a list")
            command = ()
    else:
        command = tuple(rj.command)
    if not command and isinstance(rj.command, (str, list)) and not any(
            loc.field == "job.command" for loc, _ in problems.items):
        problems.add(src.loc(("job", "command")), "command is empty")
    for i, s in enumerate(rj.sync):
        if not s.strip():
            problems.add(src.loc(("job", "sync", i)), "empty sync path")
    for loc, why in _metrics_problems(rj.metrics):
        problems.add(src.loc(("job", "metrics") + loc), why)
    for i, p in enumerate(rj.collect):
        unsafe = path_problem(p)
        if unsafe:
            problems.add(src.loc(("job", "collect", i)), f"collect: {unsafe}")
    return Job(workdir=rj.workdir, command=command, launcher=rj.launcher, platform=rj.platform,
               env={k: str(v) for k, v in rj.env.items()}, secret_env=tuple(rj.secret_env), sync=tuple(rj.sync), sync_exclude=tuple(rj.sync_exclude),
               # by default the launch host passes the code on where the hosts ssh to each other anyway
               sync_via=rj.sync_via or ("launch-host" if rj.launcher == "mpirun" and not slurm else "controller"),
               log_dir=rj.log_dir, timeout=rj.timeout, on_failure=rj.on_failure,
               mpirun_args=tuple(rj.mpirun_args), rank_table_version=rj.rank_table.version,
               master_port=rj.master_port, restarts=rj.restarts, restart_delay=rj.restart_delay,
               stall_timeout=rj.stall_timeout, interface=rj.interface, rank_dirs=rj.rank_dirs,
               hccl_connect_timeout=rj.hccl.connect_timeout, hccl_exec_timeout=rj.hccl.exec_timeout,
               metrics=dict(rj.metrics), collect=tuple(rj.collect))


def _metrics_problems(entries: Mapping[str, str]) -> list[tuple[tuple, str]]:
    """job.metrics: each name and pattern as the hosts' supervisors will use them (agent/metrics.py)."""
    out: list[tuple[tuple, str]] = []
    if len(entries) > metrics.MAX_NAMES:
        out.append(((), f"at most {metrics.MAX_NAMES} metrics ({len(entries)} given)"))
    for name, pattern in entries.items():
        try:
            metrics.check_pattern(name, pattern)
        except metrics.MetricsError as exc:
            out.append(((name,), f"metric {exc}"))
    return out


class _SshLookup(NamedTuple):
    config: SshConfig
    timeout_from_config: bool  # ssh.connect_timeout not set in cluster.yaml: ConnectTimeout applies


def _ssh_config(raw: RawCluster | None, src: Source, base: Path, problems: _Problems) -> _SshLookup | None:
    """The OpenSSH client config `ssh.config_file` names, read once per invocation (None: `none`,
    or the default ~/.ssh/config does not exist). A file named explicitly must exist."""

    name = raw.ssh.config_file if raw is not None else DEFAULT_PATH
    if name.strip().lower() == "none":
        return None
    path = os.path.expanduser(name) if name.startswith("~") else str((base / name).absolute())
    try:
        cfg = SshConfig.load(path)
    except SshConfigError as exc:
        problems.add(Location(exc.where), exc.message)
        return None
    if cfg is None and name != DEFAULT_PATH:
        problems.add(src.loc(("ssh", "config_file")), f"ssh config file {path} does not exist "
                     "(write `config_file: none` to read no ssh config)")
    if cfg is None:
        return None
    return _SshLookup(cfg, raw is None or "connect_timeout" not in raw.ssh.model_fields_set)


def _resolve_ssh(h: Host, merged: dict, lookup: _SshLookup | None, loc: Location, problems: _Problems) -> Host:
    """The host as SSH reaches it: the inventory's values, then ssh_config's for its address
    (an alias there), then the defaults; jump hosts (inventory `jump:` or ProxyJump) resolved
    the same way."""

    if h.connection != "ssh":
        return h
    cfg = lookup.config if lookup is not None else None
    try:
        r = resolve(cfg, h.address, merged.get("user"), merged.get("port"), h.user)
        e = r.entry
        ident = h.identity_file if "identity_file" in merged else r.first_identity()
        known = h.known_hosts if "known_hosts" in merged or not e.known_hosts else r.expand(e.known_hosts[0])
        if "jump" in merged:
            hops = hops_of(merged["jump"], str(loc))
        else:
            hops = parse_hops(e.proxy_jump, f"{cfg.path} (ProxyJump for {h.address})") \
                if e.proxy_jump and cfg is not None else ()
        jump = _jump_hosts(hops, cfg, ident, known, str(loc), 0)
        proxy = r.expand(e.proxy_command) if e.proxy_command and not jump else None
    except SshConfigError as exc:
        problems.add(Location(exc.where) if exc.where != str(loc) else loc, exc.message)
        return h
    if not USER_NAME.match(r.user):
        problems.add(Location(cfg.path) if cfg is not None and e.user == r.user else loc,
                     f"user {r.user!r} (for {h.address}) is not a login name")
    timeout = e.connect_timeout if lookup is not None and lookup.timeout_from_config else None
    return replace(h, user=r.user, port=r.port, hostname=r.hostname, identity_file=ident, known_hosts=known,
                   jump=jump, proxy_command=proxy, keepalive=e.server_alive_interval, connect_timeout=timeout)


def _jump_hosts(hops, cfg, ident: str | None, known: str, where: str, depth: int) -> tuple[Host, ...]:
    """Jump hosts as Hosts, each looked up in ssh_config like `ssh -J` does (its alias, user,
    port, key, and its own ProxyJump in front of it). Without a key of its own, a hop uses the
    target host's identity_file and known_hosts (the cluster's key usually opens its bastion)."""

    out: list[Host] = []
    for hop in hops:
        if depth + len(out) >= MAX_HOPS:
            raise SshConfigError(where, f"more than {MAX_HOPS} jump hosts (a ProxyJump loop?)")
        r = resolve(cfg, hop.host, hop.user, hop.port, local_user())
        e = r.entry
        kh = r.expand(e.known_hosts[0]) if e.known_hosts else known
        if e.proxy_jump and not hop.user and not hop.port and cfg is not None and not out:
            out.extend(_jump_hosts(parse_hops(e.proxy_jump, f"{cfg.path} (ProxyJump for {hop.host})"),
                                   cfg, ident, known, where, depth + 1))
        out.append(Host(name=str(hop), address=hop.host, hostname=r.hostname, user=r.user, port=r.port,
                        identity_file=r.first_identity() or ident, known_hosts=kh, keepalive=e.server_alive_interval))
    return tuple(out)


def _slurm_template(keys: dict, defaults: dict, lookup: _SshLookup | None, sub: Source,
                    problems: _Problems) -> Host:
    """The Host every allocated Slurm node becomes: the defaults, their jump hosts resolved (node
    names come from Slurm, so ssh_config is not asked about them)."""

    jump: tuple[Host, ...] = ()
    if defaults.get("jump"):
        loc = sub.loc(("defaults", "jump"))
        try:
            jump = _jump_hosts(hops_of(defaults["jump"], str(loc)),
                               lookup.config if lookup else None, keys["identity_file"], keys["known_hosts"],
                               str(loc), 0)
        except SshConfigError as exc:
            problems.add(Location(exc.where) if exc.where != str(loc) else loc, exc.message)
    return Host(name="", address="", jump=jump, **keys)


_DOTTED = re.compile(r"^\d+\.\d+\.\d+\.\d+$")


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _parse_inventory(data: dict, src: Source, prefix: tuple, base: Path, problems: _Problems,
                     ssh_config: _SshLookup | None = None) -> tuple[tuple[Host, ...], dict[str, tuple[str, ...]], Slurm | None]:
    sub = Source(src.file, {k[len(prefix):]: v for k, v in src.lines.items() if k[:len(prefix)] == prefix},
                 prefix)
    try:
        inv = RawInventory.model_validate(data)
    except ValidationError as exc:
        problems.pydantic(exc, sub, keys=_INVENTORY_KEYS)
        return (), {}, None
    defaults = inv.defaults.model_dump(exclude_none=True)
    if "mpi_address" in defaults:
        problems.add(sub.loc(("defaults", "mpi_address")), "mpi_address is one host's address: give it per host")
    if (inv.hosts is None) == (inv.slurm is None):
        problems.add(sub.loc(("slurm",) if inv.slurm is not None else ()),
                     "the inventory needs exactly one of 'hosts:' (a list of hosts) and 'slurm:' (hosts from a "
                     "Slurm allocation)" if inv.slurm is not None else "missing required key 'hosts' (or 'slurm')")
        return (), {}, None
    if inv.slurm is not None:
        if inv.spares:
            problems.add(sub.loc(("spares",)), "spares name listed hosts; a Slurm inventory lists none: ask Slurm "
                         "for spare nodes with slurm.spares: N")
        if inv.groups:
            problems.add(sub.loc(("groups",)), "groups name listed hosts; a Slurm inventory lists none")
        rs = inv.slurm
        keys = _host_keys(defaults, base, sub, ("defaults",), "devices" in defaults, problems)
        if keys["connection"] != "ssh":
            problems.add(sub.loc(("defaults", "connection")), "Slurm nodes are reached over ssh")
        conf = rs.conf
        if conf is not None:
            conf = str(Path(conf).expanduser()) if conf.startswith("~") else str((base / conf).absolute())
        login_host = None
        if rs.login:  # the login node: the defaults' user, key and jump host, but not the nodes' port
            login_keys = {k: v for k, v in defaults.items() if k != "port"}
            login_host = _resolve_ssh(Host(name=rs.login, address=rs.login, **{**keys, "port": 22}), login_keys,
                                      ssh_config, sub.loc(("slurm", "login")), problems)
        return (), {}, Slurm(**{**rs.model_dump(), "extra": tuple(rs.extra), "conf": conf},
                             template=_slurm_template(keys, defaults, ssh_config, sub, problems),
                             login_host=login_host)
    assert inv.hosts is not None
    hosts: list[Host] = []
    origin: dict[str, tuple] = {}
    seen_addr: dict[tuple, tuple] = {}
    for i, rh in enumerate(inv.hosts):
        merged = {**defaults, **rh.model_dump(exclude_none=True)}
        if "env" in defaults and rh.env is not None:
            merged["env"] = {**defaults["env"], **rh.env}
        try:
            addresses = expand(rh.address)
        except NodeSetParseError as exc:
            problems.add(sub.loc(("hosts", i, "address")), f"bad address range {rh.address!r}: {exc}")
            continue
        bad_ips = [a for a in addresses if _DOTTED.match(a) and not _is_ip(a)]
        if bad_ips:
            problems.add(sub.loc(("hosts", i, "address")), f"address range {rh.address!r} gives {len(bad_ips)} "
                         f"addresses that are not IPv4 addresses (e.g. {bad_ips[0]}): each part is 0-255")
            continue
        if rh.name is None:
            names = addresses
        else:
            try:
                names = expand_names(rh.name)
            except NodeSetParseError as exc:
                problems.add(sub.loc(("hosts", i, "name")), f"bad name {rh.name!r}: {exc}")
                continue
            if len(names) != len(addresses):
                problems.add(sub.loc(("hosts", i, "name")),
                             f"name {rh.name!r} gives {len(names)} names but address {rh.address!r} gives "
                             f"{len(addresses)} hosts; use a range of the same length, or drop name")
                continue
        keys = _host_keys(merged, base, sub, ("hosts", i), rh.devices is not None, problems)
        if rh.mpi_address is not None and len(addresses) > 1:
            problems.add(sub.loc(("hosts", i, "mpi_address")), f"mpi_address is one host's address, but "
                         f"{rh.address!r} gives {len(addresses)} hosts: give each its own entry")
        for name, addr in zip(names, addresses):
            if not name.strip() or "\n" in name or "\0" in name:
                problems.add(sub.loc(("hosts", i, "name")), f"host name {name!r} is empty or has a newline")
            elif "/" in name:  # names become file names (msrun's per-host records and logs)
                problems.add(sub.loc(("hosts", i, "name")), f"host name {name!r} must not contain '/'")
            h = _resolve_ssh(Host(name=name, address=addr, spare=rh.spare, **keys), merged, ssh_config,
                             sub.loc(("hosts", i, "jump") if rh.jump is not None else ("hosts", i)), problems)
            if name in origin:
                problems.add(sub.loc(("hosts", i)), f"duplicate host {name!r} (also from hosts[{origin[name][1]}]"
                             f", line {sub.line_of(origin[name])}); each host may appear once")
                continue
            key = (h.ssh_address, h.port, h.connection, tuple(j.target for j in h.jump))
            if h.connection == "ssh" and key in seen_addr:
                problems.add(sub.loc(("hosts", i)), f"duplicate host address {addr}:{h.port} (also "
                             f"hosts[{seen_addr[key][1]}], line {sub.line_of(seen_addr[key])})")
                continue
            origin[name] = ("hosts", i)
            seen_addr[key] = ("hosts", i)
            hosts.append(h)
    if inv.spares:
        if inv.spares >= len(hosts):
            problems.add(sub.loc(("spares",)), f"spares: {inv.spares}, but the inventory lists {len(hosts)} "
                         "host(s): at least one must run ranks")
        else:
            hosts[len(hosts) - inv.spares:] = [replace(h, spare=True) for h in hosts[len(hosts) - inv.spares:]]
    if hosts and all(h.spare for h in hosts) and not inv.spares:
        problems.add(sub.loc(("hosts",)), "every host is a spare (spare: true): at least one must run ranks")
    groups: dict[str, tuple[str, ...]] = {}
    known = {h.name for h in hosts} | {h.address for h in hosts}
    for g, members in inv.groups.items():
        expanded: list[str] = []
        for m in members:
            try:
                expanded.extend([m] if m in known else expand(m))  # a host's exact name is literal
            except NodeSetParseError as exc:
                problems.add(sub.loc(("groups", g)), f"bad member {m!r}: {exc}")
        missing = [m for m in expanded if m not in known]
        if missing:
            problems.add(sub.loc(("groups", g)), f"group {g!r} names unknown hosts: {', '.join(missing)}")
        by_addr = {h.address: h.name for h in hosts}
        groups[g] = tuple(by_addr.get(m, m) for m in expanded)
    return tuple(hosts), groups, None


def _host_keys(merged: dict, base: Path, sub: Source, where: tuple, own_devices: bool,
               problems: _Problems) -> dict:
    """A host's keys (defaults merged) resolved and checked: Host(**keys) with its name and address."""

    slots = merged.get("slots", 1)
    devices = merged.get("devices")
    if devices is None:
        devices = list(range(slots))
    elif "slots" not in merged:
        slots = len(devices)
    if len(devices) != slots:
        problems.add(sub.loc((*where, "devices") if own_devices else where),
                     f"devices {devices} lists {len(devices)} ids but slots is {slots}: they must match")
    if len(set(devices)) != len(devices):
        problems.add(sub.loc((*where, "devices")), f"devices {devices} repeats an id")
    dips = merged.get("device_ips", {})  # may list every device of the host (as /etc/hccn.conf does)
    ident = merged.get("identity_file")
    if ident:
        ident = str((base / Path(ident).expanduser()).absolute()) if not ident.startswith("~") else \
            str(Path(ident).expanduser())
    kh = merged.get("known_hosts", "~/.ssh/known_hosts")
    kh = str(Path(kh).expanduser()) if kh.startswith("~") else str((base / kh).absolute())
    return dict(user=merged.get("user") or local_user(), port=merged.get("port", 22), identity_file=ident,
                known_hosts=kh, connection=merged.get("connection", "ssh"), slots=slots, devices=tuple(devices),
                device_ips=dict(dips), env=dict(merged.get("env", {})), mpi_address=merged.get("mpi_address"),
                super_device_ids=dict(merged.get("super_device_ids", {})), super_pod_id=merged.get("super_pod_id"))
