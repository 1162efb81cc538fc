"""`orch check`: the preflight that catches what breaks multi-host training.

Every check is the command(s) it needs plus a PURE judge of their output. All of
a host's commands go out as ONE probe script over the host's ONE connection
(see probes.py for the script and the parsers); the judges below turn parsed
output into `CheckResult`s. Checks that compare hosts (same user, same
versions, same NIC name, unique device IPs) judge all hosts' data together and
give cluster-wide results (host None) that name every host involved, folded
(`lab-h[1-3]`).

    report = run_checks(cluster, pool, full_mesh=False, on_result=print)
    report.ok, report.to_json(), report.cells(), report.problems()

The checks (names from spec.KNOWN_CHECKS; `checks.skip` skips them):
ssh, mesh, user, versions, path, nic, devices, device-rules, workdir, disk,
files, ports, stale, clock, and with --deep health (health.py). A host that
cannot be reached fails `ssh` and every other check of it is `error` ("not
checked"); the other hosts' results stand.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
from dataclasses import astuple, dataclass, field
from typing import Callable, Iterable, Literal, Mapping, Sequence

from . import health, probes
from .errors import HostError, OrchError
from .fanout import fan_out
from .probes import MeshTarget, ProbeError, Section, SyncFile
from .devices import parse_npu_smi_dies
from .spec import KNOWN_CHECKS, Cluster, Host, fold

Status = Literal["pass", "warn", "fail", "error"]
SEVERITY = {"pass": 0, "warn": 1, "error": 2, "fail": 3}
HEAD_START = 1.0  # seconds the other hosts give the mesh sources to connect first


@dataclass(frozen=True)
class CheckResult:
    check: str
    host: str | None  # None: cluster-wide (a version mismatch...)
    status: Status
    message: str
    hosts: tuple[str, ...] = field(default=(), compare=False)  # cluster-wide: the hosts it is about

    def to_dict(self) -> dict:
        return {"check": self.check, "host": self.host, "status": self.status, "message": self.message}


@dataclass(frozen=True)
class Problem:
    """One non-pass message, shown once for every host that gave it."""

    status: Status
    check: str
    hosts: str | None  # folded host set, None for a cluster-wide result
    message: str


@dataclass
class Report:
    results: list[CheckResult]
    hosts: tuple[str, ...] = ()  # host names in plan order
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(r.status in ("fail", "error") for r in self.results)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "results": [r.to_dict() for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def checks(self) -> list[str]:
        """Checks that produced a result, in KNOWN_CHECKS order."""
        seen = {r.check for r in self.results}
        return [c for c in KNOWN_CHECKS if c in seen]

    def cells(self) -> dict[str, dict[str, Status]]:
        """{host: {check: worst status}} from per-host results and cluster-wide results naming the host."""
        out: dict[str, dict[str, Status]] = {h: {} for h in self.hosts}
        for r in self.results:
            for h in ([r.host] if r.host is not None else r.hosts):
                row = out.setdefault(h, {})
                cur = row.get(r.check)
                if cur is None or SEVERITY[r.status] > SEVERITY[cur]:
                    row[r.check] = r.status
        return out

    def problems(self) -> list[Problem]:
        """Each non-pass message once, with the folded set of hosts that gave it; worst first."""
        groups: dict[tuple, list[str]] = {}
        order: list[tuple] = []
        for r in self.results:
            if r.status == "pass":
                continue
            key = (r.status, r.check, r.host is None, r.message)
            if key not in groups:
                groups[key] = []
                order.append(key)
            if r.host is not None:
                groups[key].append(r.host)
        rank = {c: i for i, c in enumerate(KNOWN_CHECKS)}
        merged: dict[tuple, list[str]] = {}  # the same message for the same hosts from several checks: once
        for k in order:
            hosts = None if k[2] else fold(groups[k])
            merged.setdefault((k[0], hosts, k[3]), []).append(k[1])
        out = [Problem(st, ",".join(checks), hosts, msg) for (st, hosts, msg), checks in merged.items()]
        out.sort(key=lambda p: (-SEVERITY[p.status], rank.get(p.check.split(",")[0], 99)))
        return out


# --------------------------------------------------------------------------- what runs where


def plan_order(hosts: Iterable[Host]) -> tuple[Host, ...]:
    """Hosts in the order of the rank plan (plan.order_hosts): the first one is the launch host."""
    from .plan import order_hosts

    return order_hosts(hosts)


def active_checks(cluster: Cluster) -> list[str]:
    return [c for c in KNOWN_CHECKS if c not in cluster.checks.skip]


def needed_tools(cluster: Cluster) -> list[str]:
    """Tools the launch cannot do without (their absence everywhere is a fail)."""
    job = cluster.job
    out = ["python"]
    if job.launcher == "mpirun":
        out.append("openmpi")
    if job.launcher == "msrun" or (job.platform == "ascend" and job.launcher != "torchrun"):
        out.append("mindspore")
    if job.launcher == "torchrun":
        out.append("torch")
    if job.platform == "ascend":
        out.append("cann")
    if job.platform == "gpu":
        out += ["nccl", "cuda-driver"]
    return out


def version_tools(cluster: Cluster) -> list[str]:
    """checks.versions if given, else the defaults for the launcher and platform."""
    if cluster.checks.versions is not None:
        return list(dict.fromkeys(cluster.checks.versions))
    return needed_tools(cluster)


def mesh_sources(cluster: Cluster, full_mesh: bool) -> list[Host]:
    hosts = plan_order(cluster.hosts)
    if len(hosts) < 2 or not (cluster.job.launcher == "mpirun" or full_mesh):
        return []
    return list(hosts) if full_mesh else [hosts[0]]


def mesh_targets(cluster: Cluster, source: Host) -> list[MeshTarget]:
    """Every other host, as mpirun will ssh to it: the address and ssh options mpirun gets
    (connection: local hosts are this machine)."""
    from .render import ssh_args

    return [MeshTarget(h.name, h.cluster_address, tuple(ssh_args(source, h))) for h in plan_order(cluster.hosts)
            if h.name != source.name and h.connection == "ssh"]


def sync_manifest(cluster: Cluster) -> tuple[list[SyncFile], list[str]]:
    """(files orch up will copy, with size and sha256; why job.sync entries cannot be synced). Reads
    local files.

    Uses sync.manifest, entry by entry, so the paths in workdir are exactly the ones `orch up` writes."""
    from .errors import SpecError
    from .sync import manifest

    files: list[SyncFile] = []
    missing: list[str] = []
    for entry in cluster.job.sync:
        try:
            got = manifest(cluster.base_dir, (entry,), str(cluster.path), cluster.job.sync_exclude, hashed=True)
        except SpecError as exc:
            missing += [msg for _, msg in exc.problems]
            continue
        files += [SyncFile(e.rel, e.size, e.sha256 if e.size <= probes.HASH_LIMIT else None)
                  for e in got if e.kind == "file"]
    return files, missing


@dataclass(frozen=True)
class CheckPlan:
    """Everything decided before any host is touched."""

    cluster: Cluster
    checks: tuple[str, ...]
    hosts: tuple[Host, ...]  # plan order
    launch: Host
    tools: tuple[str, ...]
    needed: tuple[str, ...]
    manifest: tuple[SyncFile, ...]
    missing_sync: tuple[str, ...]
    mesh_from: frozenset[str]
    full_mesh: bool

    def script(self, host: Host) -> str:
        return probes.probe_script(
            self.cluster, host, checks=self.checks, manifest=self.manifest,
            mesh_targets=mesh_targets(self.cluster, host) if host.name in self.mesh_from else (),
            versions=self.tools, launch_host=host.name == self.launch.name,
            launch_address=self.launch.cluster_address)

    def applies(self, check: str, host: Host) -> bool:
        """Does this per-host check have a result for this host?"""
        job = self.cluster.job
        if check not in self.checks:
            return False
        if check in ("devices", "health"):  # health: only in checks with --deep
            return job.platform in ("ascend", "gpu")
        if check == "ports":
            return job.launcher in ("msrun", "torchrun") and host.name == self.launch.name
        if check == "mesh":
            return host.name in self.mesh_from
        if check == "files":
            return bool(self.manifest)
        return check != "device-rules"  # cluster-wide only


def make_check_plan(cluster: Cluster, *, full_mesh: bool = False, deep: bool = False) -> CheckPlan:
    checks = tuple(c for c in active_checks(cluster) if deep or c != "health")
    hosts = plan_order(cluster.hosts)
    manifest, missing = sync_manifest(cluster) if "files" in checks else ([], [])
    return CheckPlan(cluster=cluster, checks=checks, hosts=hosts, launch=hosts[0],
                     tools=tuple(version_tools(cluster)), needed=tuple(needed_tools(cluster)),
                     manifest=tuple(manifest), missing_sync=tuple(missing),
                     mesh_from=frozenset(h.name for h in mesh_sources(cluster, full_mesh)),
                     full_mesh=full_mesh)


def probe_for(cluster: Cluster, host_name: str, *, full_mesh: bool = False, deep: bool = False) -> str:
    """The probe script `orch check` would run on one host (`orch check --print-probe HOST`)."""
    plan = make_check_plan(cluster, full_mesh=full_mesh, deep=deep)
    return plan.script(cluster.host(host_name))


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class ProbeRun:
    """What came back from one host: the parsed sections, or why there are none."""

    host: Host
    sections: Mapping[str, Section] | None
    error: OrchError | None = None
    stage: Literal["connect", "probe"] | None = None
    t_send: float = 0.0  # wall clock (time.time()) when the probe was sent ...
    t_recv: float = 0.0  # ... and when its output was back
    connect_time: float = 0.0
    addresses: frozenset[str] | None = None  # the inventory address as IPs (None: DNS name not resolvable here)


def probe_host(plan: CheckPlan, pool, host: Host, on_connected: Callable[[], None] | None = None) -> ProbeRun:
    """Connect (once) and run the probe. Never raises an OrchError: it becomes part of the ProbeRun.
    `on_connected` is called once the connection is up or has failed."""
    transport = pool[host]
    addresses = resolve_address(host.cluster_address)
    c0 = time.monotonic()
    try:
        transport.connect()
    except OrchError as exc:
        return ProbeRun(host, None, exc, "connect", connect_time=time.monotonic() - c0, addresses=addresses)
    finally:
        if on_connected is not None:
            on_connected()
    connect_time = time.monotonic() - c0
    script = plan.script(host)
    t_send = time.time()
    try:
        res = transport.run(script)  # on stdin, whatever its size (Transport.run)
    except OrchError as exc:
        return ProbeRun(host, None, exc, "probe", connect_time=connect_time, addresses=addresses)
    t_recv = time.time()
    sections = probes.split_sections(res.out)
    if not sections:
        tail = (res.err.strip() or res.out.strip())[-300:]
        return ProbeRun(host, None, HostError(host.name, f"the probe printed nothing usable (exit code "
                                              f"{res.exit_code}){': ' + tail if tail else ''}"),
                        "probe", connect_time=connect_time, addresses=addresses)
    return ProbeRun(host, sections, None, None, t_send, t_recv, connect_time, addresses)


def run_checks(cluster: Cluster, pool, *, full_mesh: bool = False, deep: bool = False,
               on_result: Callable[[CheckResult], None] | None = None) -> Report:
    """Run every check on every host of `cluster` (one probe per host, `cluster.ssh.fanout` at once);
    deep: also the device health probes (check `health`)."""
    t0 = time.monotonic()
    plan = make_check_plan(cluster, full_mesh=full_mesh, deep=deep)
    results: list[CheckResult] = []

    def emit(rs: Iterable[CheckResult]) -> None:
        for r in rs:
            results.append(r)
            if on_result:
                on_result(r)

    emit(judge_cluster_local(plan))
    runs: dict[str, ProbeRun] = {}

    def done(outcome) -> None:
        run = outcome.value if outcome.ok else ProbeRun(outcome.host, None, outcome.error, "probe")
        runs[outcome.host.name] = run
        emit(judge_host(plan, run))

    # The mesh sources' probes (ssh to every other host) take longest: they connect first, alone, so
    # that their handshakes do not queue behind every other host's (the others wait at most
    # HEAD_START seconds for them). At 64 hosts that took ~0.6 s off the launch host's probe,
    # which is the whole check's wall time.
    waiting = {h.name for h in plan.hosts if h.name in plan.mesh_from}
    heads_up = threading.Event()
    if not waiting or len(waiting) == len(plan.hosts):
        heads_up.set()
    lock = threading.Lock()

    def connected(name: str) -> None:
        with lock:
            waiting.discard(name)
            if not waiting:
                heads_up.set()

    def probe(h: Host) -> ProbeRun:
        if h.name in plan.mesh_from:
            return probe_host(plan, pool, h, on_connected=lambda: connected(h.name))
        heads_up.wait(HEAD_START)
        return probe_host(plan, pool, h)

    ssh = cluster.ssh
    budget = ssh.connect_timeout * ssh.retries + 2.0 * ssh.retries + ssh.command_timeout + 5 + HEAD_START
    fan_out(plan.hosts, probe, limit=ssh.fanout, timeout=budget, on_done=done)
    emit(judge_across(plan, [runs[h.name] for h in plan.hosts]))
    order = {c: i for i, c in enumerate(KNOWN_CHECKS)}
    hidx = {h.name: i for i, h in enumerate(plan.hosts)}
    results.sort(key=lambda r: (order.get(r.check, 99), hidx.get(r.host, len(hidx)) if r.host else len(hidx)))
    return Report(results, tuple(h.name for h in plan.hosts), time.monotonic() - t0)


def resolve_address(address: str) -> frozenset[str] | None:
    """An inventory address as IPs, resolved on this machine (None: a DNS name that does not resolve)."""
    try:
        return frozenset({str(ipaddress.ip_address(address))})
    except ValueError:
        pass
    try:
        return frozenset(ai[4][0] for ai in socket.getaddrinfo(address, None))
    except OSError:
        return None


# --------------------------------------------------------------------------- judging one host


class _Missing(Exception):
    pass


def _get(sections: Mapping[str, Section], name: str) -> Section:
    s = sections.get(name)
    if s is None:
        raise _Missing(f"the probe printed no '{name}' section (it stopped early, or its output was cut)")
    if not s.finished:
        raise _Missing(f"the probe was cut off during '{name}': {probes.quote_output(s.body)}")
    return s


def _r(check: str, host: Host | str | None, status: Status, message: str, hosts: Iterable[str] = ()) -> CheckResult:
    name = host.name if isinstance(host, Host) else host
    return CheckResult(check, name, status, message, tuple(hosts))


def _host_message(err: OrchError, host: Host) -> str:
    msg = err.message
    prefix = f"{host.name}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix):]
    return msg + (f"; {err.hint}" if err.hint else "")


PER_HOST = ("ssh", "mesh", "user", "path", "nic", "devices", "workdir", "disk", "files", "ports", "stale",
            "clock", "health")


def judge_host(plan: CheckPlan, run: ProbeRun) -> list[CheckResult]:
    """Every per-host result of one host, from its ProbeRun (pure)."""
    host = run.host
    out: list[CheckResult] = []
    applicable = [c for c in PER_HOST if plan.applies(c, host)]
    if run.sections is None:
        err = run.error or HostError(host.name, "no answer")
        if run.stage == "connect":
            why = "not checked: SSH to the host failed"
            msg = _host_message(err, host)
            if f"{host.user}@{host.ssh_address}" not in msg:
                msg = f"{host.route}: {msg}"
        else:
            why = "not checked: the probe did not complete on the host"
            msg = f"connected to {host.target} but the probe failed: {_host_message(err, host)}"
        if "ssh" in applicable:
            out.append(_r("ssh", host, "fail", msg))
        # versions are judged across hosts; this host's data is simply absent
        out += [_r(c, host, "error", why) for c in applicable if c != "ssh"]
        if "versions" in plan.checks:
            out.append(_r("versions", host, "error", why))
        return out
    s = run.sections
    judges: dict[str, Callable[[], list[CheckResult]]] = {
        "ssh": lambda: [_r("ssh", host, "pass", f"{host.route} ({'local' if host.connection == 'local' else 'ssh'},"
                                                  f" {run.connect_time:.2f}s to connect)")],
        "mesh": lambda: [judge_mesh(host, _get(s, "mesh"), mesh_targets(plan.cluster, host),
                                    plan.cluster.ssh.connect_timeout, plan.cluster.ssh.command_timeout)],
        "user": lambda: [judge_user(host, _get(s, "user"), plan.cluster.job.launcher)],
        "path": lambda: [judge_path(plan.cluster, host, _get(s, "path"))],
        "nic": lambda: [judge_nic(host, _get(s, "nic"), run.addresses)[0]]
        + ([judge_interface(plan.cluster, host, _get(s, "iface"))] if plan.cluster.job.interface else []),
        "devices": lambda: [judge_devices(plan.cluster, host, s)],
        "workdir": lambda: [judge_workdir(plan.cluster, host, _get(s, "workdir"))],
        "disk": lambda: [judge_disk(plan.cluster, host, _get(s, "df"))],
        "files": lambda: [judge_files(host, _get(s, "files"), plan.manifest)],
        "ports": lambda: [judge_ports(plan.cluster, host, _get(s, "ports"))],
        "stale": lambda: judge_stale(host, _get(s, "stale")),
        "clock": lambda: [judge_clock(host, _get(s, "clock0"), _get(s, "clock1"), run.t_send, run.t_recv,
                                      plan.cluster.checks.clock_skew)],
        "health": lambda: [_r("health", host, *astuple(health.judge(plan.cluster, host, s)))],
    }
    for c in applicable:
        try:
            out += judges[c]()
        except _Missing as exc:
            out.append(_r(c, host, "error", str(exc)))
        except ProbeError as exc:
            out.append(_r(c, host, "error", str(exc)))
    if "versions" in plan.checks:
        try:
            host_versions(s, plan.tools)
        except (ProbeError, _Missing) as exc:
            out.append(_r("versions", host, "error", str(exc)))
    return out


def judge_user(host: Host, sec: Section, launcher: str = "mpirun") -> CheckResult:
    user = sec.body.strip()
    if sec.rc != 0 or not user or len(user.split()) != 1:
        return _r("user", host, "error", f"`id -un` failed: {probes.quote_output(sec.body)}")
    if user == "root":
        return _r("user", host, "warn", "logged in as root"
                  + (": mpirun needs --allow-run-as-root (orch adds it)" if launcher == "mpirun" else "")
                  + "; a non-root user is safer")
    return _r("user", host, "pass", f"logged in as {user}")


_PATH_HINT_ORTED = ("mpirun starts orted on every host over a non-interactive ssh: add `--prefix <openmpi dir>` "
                    "to job.mpirun_args, or set PATH in the user's ~/.bashrc BEFORE its "
                    "'if not interactive, return' line")


def judge_path(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    info = probes.parse_path(sec.body)
    tools: dict = info["tools"]  # type: ignore[assignment]
    env_path = probes.tool_env(cluster, host).get("PATH")
    missing_job, missing_plain, missing_fixed, found = [], [], [], []
    for label, how in probes.launch_tools(cluster):
        path = tools.get(label)
        if path:
            found.append(f"{label}={path}")
        elif how == "job":
            missing_job.append(label)
        elif how == "plain":
            missing_plain.append(label)
        else:
            missing_fixed.append((label, how))
    problems = []
    if not env_path:  # one PATH for everything: say it once
        missing_plain, missing_job = missing_job + missing_plain, []
    if missing_job:
        hint = "fix PATH in job.env" + (", or install Open MPI (mpirun)" if "mpirun" in missing_job else "")
        problems.append(f"{', '.join(missing_job)} not found on job.env PATH={env_path}: {hint}")
    if missing_plain:
        hints = []
        if any(t != "orted" for t in missing_plain):
            hints.append("install it, or set PATH in job.env "
                         "(e.g. PATH: /opt/openmpi/bin:/usr/local/bin:/usr/bin:/bin)")
        if "orted" in missing_plain or "mpirun" in missing_plain:
            hints.append(_PATH_HINT_ORTED)
        problems.append(f"{', '.join(missing_plain)} not found on the non-interactive ssh PATH={info['PATH']}: "
                        + "; ".join(hints))
    for label, path in missing_fixed:
        prefix = probes.mpirun_prefix(cluster.job.mpirun_args)
        why = f" (from mpirun --prefix {prefix})" if label == "orted" and prefix else ""
        problems.append(f"{path} is not an executable on this host{why}")
    if info["supervisor"] is not None:
        from .supervisor import python_problem

        sup = python_problem(info["supervisor"])
        if sup:
            problems.append(sup + ": install python3, or put it on the PATH a non-interactive ssh gets")
        else:
            found.insert(0, f"python3={info['supervisor']} (supervisor)")
    if problems:
        return _r("path", host, "fail", "; ".join(problems))
    return _r("path", host, "pass", " ".join(found) if found else "nothing to look up")


def judge_nic(host: Host, sec: Section, resolved: Iterable[str] | None) -> tuple[CheckResult, probes.IfAddr | None]:
    """Is the inventory address one of the host's own? -> (result, the interface address carrying it)."""
    if host.connection == "local" and host.cluster_address in ("127.0.0.1", "localhost", "::1"):
        return _r("nic", host, "pass", "this machine (connection: local)"), None
    addrs = probes.parse_ip_addrs(sec.body)
    wanted = set(resolved or ())
    if not wanted:
        try:
            wanted = {str(ipaddress.ip_address(host.cluster_address))}
        except ValueError:
            return _r("nic", host, "warn", f"cannot resolve {host.cluster_address} on this machine, so cannot tell "
                                           "which interface carries it"), None
    for a in addrs:
        if a.address in wanted:
            where = f"on {a.ifname}" if a.ifname else "assigned (interface name unknown: no `ip` command)"
            return _r("nic", host, "pass", f"{a.address} {where}"), a
    have = ", ".join(f"{a.ifname + ' ' if a.ifname else ''}{a.address}" for a in addrs
                     if not a.address.startswith(("127.", "::1", "fe80:"))) or "none"
    return _r("nic", host, "fail", f"{host.cluster_address} is not an address of this host (it has: {have}); the "
                                   "launcher will hand out this address for ranks to reach the host: use the "
                                   "address the hosts reach each other on in the inventory"), None


def judge_devices(cluster: Cluster, host: Host, sections: Mapping[str, Section]) -> CheckResult:
    if cluster.job.platform == "gpu":
        sec = _get(sections, "gpus")
        if sec.rc not in (0, None) and "GPU " not in sec.body:
            return _r("devices", host, "fail", f"nvidia-smi -L failed (exit {sec.rc}): {probes.quote_output(sec.body)}")
        gpus = probes.parse_nvidia_smi_l(sec.body)
        if gpus is None:
            return _r("devices", host, "fail", "nvidia-smi not found: cannot see the GPUs "
                                               "(is the NVIDIA driver installed and on PATH?)")
        lacking = [d for d in host.devices if d not in gpus]
        if lacking:
            return _r("devices", host, "fail", f"planned GPUs {lacking} do not exist: nvidia-smi -L lists "
                                               f"{_ids(gpus)}; fix devices/slots in the inventory")
        names = sorted({gpus[d] for d in host.devices})
        return _r("devices", host, "pass", f"GPUs {_ids(host.devices)} present ({', '.join(names)})")
    # ascend
    hccn = probes.parse_hccn(_get(sections, "hccn").body)
    npu_sec = sections.get("npu")
    npus = None
    npu_note = ""
    if npu_sec is not None and npu_sec.finished:
        try:
            # Atlas A3: one row pair per die, devices are the dies' physical ids (devices.py)
            npus = parse_npu_smi_dies(npu_sec.body) or probes.parse_npu_smi(npu_sec.body)
        except ProbeError as exc:
            npu_note = f"; npu-smi info not understood ({exc})"
    problems, warnings = [], []
    if npus is not None:
        lacking = [d for d in host.devices if d not in npus]
        if lacking:
            problems.append(f"planned NPUs {lacking} do not exist: npu-smi info lists {_ids(npus)}")
        sick = [f"{d} ({npus[d]})" for d in host.devices if d in npus and npus[d].upper() != "OK"]
        if sick:
            warnings.append(f"NPU health not OK: {', '.join(sick)}")
    no_ip = [d for d in host.devices if d not in host.device_ips and (hccn is None or hccn.get(d) is None
                                                                       or hccn[d].address is None)]
    if no_ip:
        where = f"{probes.HCCN_CONF} does not exist" if hccn is None else \
            f"{probes.HCCN_CONF} has no address_<id> for them"
        problems.append(f"no device IP for planned devices {no_ip}: {where} and the inventory gives no "
                        "device_ips (set them with hccn_tool -i <id> -ip -s address <ip> netmask <mask>)")
    bad = []
    for d in host.devices:
        ip = host.device_ips.get(d) or (hccn.get(d).address if hccn and hccn.get(d) else None)
        if ip is not None:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                bad.append(f"{d}={ip}")
    if bad:
        problems.append(f"device IPs that are not IP addresses: {', '.join(bad)}")
    if problems:
        return _r("devices", host, "fail", "; ".join(problems + warnings) + npu_note)
    if warnings:
        return _r("devices", host, "warn", "; ".join(warnings) + npu_note)
    seen = "" if npus is not None else " (npu-smi not found: presence not checked)"
    return _r("devices", host, "pass", f"device IPs for devices {_ids(host.devices)}{seen}{npu_note}")


def _ids(ids) -> str:
    ids = sorted(ids)
    return fold(str(i) for i in ids) if ids else "none"


def judge_workdir(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    w = probes.parse_workdir(sec.body)
    wd = cluster.job.workdir
    if w.mkdir_error:
        return _r("workdir", host, "fail", f"{wd} does not exist and cannot be created: {w.mkdir_error.strip()}; "
                                           "choose another job.workdir or create it with the right owner")
    if not w.writable:
        return _r("workdir", host, "fail", f"{wd} is not writable: {(w.write_error or 'unknown').strip()}; "
                                           "fix its owner/permissions or choose another job.workdir")
    unsafe = workdir_exposure(w)
    if unsafe:
        return _r("workdir", host, "fail", f"{unsafe}: another user could replace what the ranks run (as "
                                           "OpenSSH's StrictModes refuses for ~/.ssh)")
    return _r("workdir", host, "pass", f"{wd} {'exists' if w.existed else 'created'}, writable")


def workdir_exposure(w: probes.Workdir) -> str | None:
    """Why another user could change files in the workdir: it or a parent is writable by group or
    others (a root-owned sticky directory such as /tmp excepted), or owned by someone else."""
    for mode, owner, path in w.perms:
        if w.uid is not None and owner not in (0, w.uid):
            return f"{path} is owned by uid {owner}, not by the job's user (uid {w.uid}) or root; fix: use a " \
                   "workdir under directories you own"
        if mode & 0o022 and not (mode & 0o1000 and owner == 0):
            return f"{path} is writable by {'group and others' if mode & 0o022 == 0o022 else 'its group' if mode & 0o020 else 'others'} " \
                   f"(mode {mode & 0o7777:o}); fix: chmod go-w {path}"
    return None


def judge_disk(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    if sec.rc != 0 and not sec.body.strip().startswith("Filesystem"):
        return _r("disk", host, "error", f"df -Pk failed (exit {sec.rc}): {probes.quote_output(sec.body)}")
    d = probes.parse_df(sec.body)
    free = d.avail_kib / (1 << 20)
    need = cluster.checks.min_free_gib
    if free < need:
        return _r("disk", host, "fail", f"only {free:.1f} GiB free on {d.mount} (holds {cluster.job.workdir}); "
                                        f"checks.min_free_gib is {need:g}: free some space")
    return _r("disk", host, "pass", f"{free:.1f} GiB free on {d.mount}")


def judge_files(host: Host, sec: Section, manifest: Sequence[SyncFile]) -> CheckResult:
    body = sec.body
    if "orch:no-workdir" in body:
        return _r("files", host, "pass", f"not synced yet: orch up copies {len(manifest)} file(s)")
    if "orch:no-sha256sum" in body:
        return _r("files", host, "warn", "sha256sum is not on the host: cannot compare the synced files")
    remote = probes.parse_sha256sum(body)
    compared = manifest[:probes.MAX_COMPARED_FILES]
    stale, current = [], 0
    for f in compared:
        got = remote.get(f.rel)
        if got is None:
            continue
        want = f.sha256 if f.sha256 is not None else f"size:{f.size}"
        if got == want:
            current += 1
        else:
            stale.append(f.rel)
    extra = f"; {len(manifest) - len(compared)} more not compared" if len(manifest) > len(compared) else ""
    if stale:
        shown = ", ".join(stale[:10]) + (f" and {len(stale) - 10} more" if len(stale) > 10 else "")
        return _r("files", host, "warn", f"stale code on the host: {shown} differ from this machine's "
                                         f"(orch up will re-sync them){extra}")
    absent = len(compared) - current
    if current == 0:
        return _r("files", host, "pass", f"not synced yet: orch up copies {len(manifest)} file(s)")
    if absent:
        return _r("files", host, "pass", f"{current} file(s) up to date, {absent} not there yet (orch up copies "
                                         f"them){extra}")
    return _r("files", host, "pass", f"{current} file(s) up to date{extra}")


def judge_ports(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    port = cluster.job.master_port
    listening = probes.parse_listening_ports(sec.body)
    if port in listening:
        return _r("ports", host, "fail", f"master_port {port} is already in use on the launch host (something "
                                         "listens on it; a leftover msrun scheduler or torchrun store?): stop it or "
                                         "change "
                                         "job.master_port")
    return _r("ports", host, "pass", f"master_port {port} is free")


def judge_stale(host: Host, sec: Section) -> list[CheckResult]:
    runs = probes.parse_stale(sec.body)
    if not runs:
        return [_r("stale", host, "pass", "no processes of an earlier orch run")]
    out = []
    for run_id, pids in sorted(runs.items()):
        shown = ", ".join(map(str, sorted(pids)[:8])) + (" ..." if len(pids) > 8 else "")
        out.append(_r("stale", host, "warn", f"{len(pids)} process(es) of orch run {run_id} still alive "
                                             f"(pid {shown}): stop them with `orch down --run {run_id}`"))
    return out


def clock_skew(first: Section, last: Section, t_send: float, t_recv: float) -> tuple[float, float]:
    """(the host's clock minus this machine's, what the round trip cannot tell apart), in seconds."""
    r0, r1 = probes.parse_clock(first.body), probes.parse_clock(last.body)
    return (r0 + r1) / 2 - (t_send + t_recv) / 2, max(0.0, ((t_recv - t_send) - (r1 - r0)) / 2)


def judge_hccl_timeout(cluster: Cluster, skews: Sequence[float], sent: Sequence[float]) -> list[CheckResult]:
    """Ascend: HCCL gives ranks HCCL_CONNECT_TIMEOUT to find each other. Hosts whose clocks, or
    whose probes (sent once each host was reached: how staggered a launch is) are already half of
    that apart will start their ranks further apart than that some day: warn before EI0006
    ("Getting socket times out")."""
    if cluster.job.platform != "ascend" or max(len(skews), len(sent)) < 2:
        return []
    from .render import hccl_connect_timeout

    limit = hccl_connect_timeout(cluster, len(cluster.hosts))
    skew = max(skews) - min(skews) if skews else 0.0
    spread = max(sent) - min(sent) if sent else 0.0
    if max(skew, spread) < limit / 2:
        return []
    return [CheckResult("clock", None, "warn", f"the hosts' clocks are {skew:.0f}s apart and reaching them all "
                        f"took {spread:.0f}s, while HCCL_CONNECT_TIMEOUT is {limit}s: ranks that start further apart "
                        "than that fail with EI0006; raise job.hccl.connect_timeout (at most 7200) and run NTP")]


def judge_clock(host: Host, first: Section, last: Section, t_send: float, t_recv: float,
                limit: float) -> CheckResult:
    """Skew = host's midpoint - controller's midpoint; only beyond what the round trip can explain."""
    if not t_send or not t_recv:
        return _r("clock", host, "error", "no send/receive times to compare the clock with")
    skew, slack = clock_skew(first, last, t_send, t_recv)
    if abs(skew) - slack > limit:
        way = "ahead of" if skew > 0 else "behind"
        return _r("clock", host, "warn", f"clock is {abs(skew):.1f}s {way} this machine's (more than "
                                         f"checks.clock_skew {limit:g}s): timeouts and log times will disagree; "
                                         "run NTP (chrony/systemd-timesyncd)")
    return _r("clock", host, "pass", f"within {max(abs(skew), slack):.2f}s of this machine's")


def judge_mesh(host: Host, sec: Section, targets: Sequence[MeshTarget], connect_timeout: float,
               command_timeout: float = 120) -> CheckResult:
    got = probes.parse_mesh(sec.body)
    if got is None:
        return _r("mesh", host, "fail", "no ssh client on this host: mpirun needs one to start its daemons on the "
                                        "other hosts")
    failing: dict[str, list[str]] = {}
    for t in targets:
        rc, err = got.get(t.name, (None, ""))
        if rc == 0:
            continue
        if rc is None:
            why = "no answer from the test"
        elif rc == 124 and not err:
            limit = max(round(connect_timeout) + 10, int(command_timeout * 0.8))
            why = f"connected but no answer within {limit}s (ssh was stopped)"
        elif "timed out" in err.lower():
            why = err
        else:
            why = err or f"ssh exited with {rc}"
        failing.setdefault(why, []).append(t.name)
    if not failing:
        return _r("mesh", host, "pass", f"password-free ssh (BatchMode) to {len(targets)} host(s), as mpirun does")
    parts = [f"{fold(names)}: {why}" for why, names in failing.items()]
    hint = _mesh_hint(" ".join(failing))
    n = sum(len(v) for v in failing.values())
    return _r("mesh", host, "fail", f"cannot ssh (BatchMode, as mpirun does) to {n} of {len(targets)} host(s): "
                                    + "; ".join(parts) + (f"; {hint}" if hint else ""))


def _mesh_hint(errors: str) -> str:
    e = errors.lower()
    if "host key verification failed" in e or "no matching host key" in e:
        return ("add the other hosts' keys to this host's ~/.ssh/known_hosts (ssh-keyscan), since mpirun's ssh "
                "cannot prompt")
    if "permission denied" in e:
        return "give this host's user key access to the others (ssh-copy-id from this host), or use ssh-agent"
    if "timed out" in e or "no route" in e or "refused" in e:
        return "check that the hosts reach each other on these addresses (firewall, routes, sshd running)"
    return ""


# --------------------------------------------------------------------------- judging across hosts


def host_versions(sections: Mapping[str, Section], tools: Sequence[str]) -> dict[str, str | None]:
    """One host's {tool: version or None (not installed)} from its probe sections."""
    out: dict[str, str | None] = {}
    dists: dict[str, str | None] = {}
    want_dists = [t for t in tools if t in probes.DIST_TOOLS] + (list(probes.NCCL_DISTS) if "nccl" in tools else [])
    if want_dists:
        dists = probes.parse_dists(_get(sections, "ver:dists").body, want_dists)
    for t in tools:
        if t == "python":
            out[t] = probes.parse_python_version(_get(sections, "ver:python").body)
        elif t == "openmpi":
            out[t] = probes.parse_openmpi_version(_get(sections, "ver:openmpi").body)
        elif t in probes.DIST_TOOLS:
            out[t] = dists[t]
        elif t == "nccl":
            out[t] = probes.parse_nccl_version(_get(sections, "ver:nccl").body, dists)
        elif t == "cann":
            out[t] = probes.parse_cann_version(_get(sections, "ver:cann").body)
        elif t == "cuda-driver":
            out[t] = probes.parse_cuda_driver_version(_get(sections, "ver:cuda-driver").body)
    return out


def _vkey(v: str | None):
    if v is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(v)  # 2.10 == 2.10.0
    except InvalidVersion:
        return v.strip()


def judge_versions(per_host: Mapping[str, Mapping[str, str | None]], tools: Sequence[str],
                   needed: Sequence[str], launcher: str = "mpirun") -> list[CheckResult]:
    """{host: {tool: version|None}} (hosts in plan order) -> cluster-wide results (pure).

    One fail per mismatching tool, naming each version with its folded host set."""
    hosts = list(per_host)
    if not hosts:
        return []
    out: list[CheckResult] = []
    same: list[str] = []
    for t in tools:
        groups: dict = {}
        shown: dict = {}
        for h in hosts:
            v = per_host[h].get(t)
            k = _vkey(v)
            groups.setdefault(k, []).append(h)
            shown.setdefault(k, v)
        if len(groups) > 1:
            order = sorted(groups, key=lambda k: (k is None, -len(groups[k]), str(k)))
            parts = [(f"not installed on {fold(groups[k])}" if k is None else f"{shown[k]} on {fold(groups[k])}")
                     for k in order]
            out.append(CheckResult("versions", None, "fail", f"{t}: " + "; ".join(parts), tuple(hosts)))
            continue
        (k, members), = groups.items()
        if k is None:
            if t in needed:
                why = {"openmpi": f"the {launcher} launcher needs Open MPI", "mindspore": "the job needs MindSpore",
                       "python": "the job runs python"}.get(t, "the platform needs it")
                out.append(CheckResult("versions", None, "fail", f"{t}: not installed on any host "
                                       f"({fold(members)}); {why}", tuple(hosts)))
            else:
                out.append(CheckResult("versions", None, "warn", f"{t}: not installed on any host ({fold(members)})",
                                       tuple(hosts)))
            continue
        if t == "openmpi" and launcher == "mpirun" and not str(k)[0].isdigit():
            out.append(CheckResult("versions", None, "fail", f"openmpi: mpirun is {shown[k]} on {fold(members)}, "
                                   "not Open MPI; orch's mpirun launcher needs Open MPI", tuple(hosts)))
            continue
        same.append(f"{t} {shown[k]}")
    if same:
        out.insert(0, CheckResult("versions", None, "pass", f"{', '.join(same)} on {fold(hosts)}", tuple(hosts)))
    return out


def judge_users(per_host: Mapping[str, str], launcher: str) -> list[CheckResult]:
    """{host: login user} -> a cluster-wide fail (mpirun) or warn when they differ."""
    groups: dict[str, list[str]] = {}
    for h, u in per_host.items():
        groups.setdefault(u, []).append(h)
    if len(groups) <= 1:
        return []
    parts = "; ".join(f"{u} on {fold(hs)}" for u, hs in sorted(groups.items(), key=lambda kv: -len(kv[1])))
    if launcher == "mpirun":
        return [CheckResult("user", None, "fail", f"the login user differs: {parts}; mpirun logs in to every host "
                            "as the launch host's user: use the same user everywhere (inventory defaults.user)",
                            tuple(per_host))]
    return [CheckResult("user", None, "warn", f"the login user differs: {parts}", tuple(per_host))]


def judge_interface(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    """job.interface on this host: it must exist and have an IPv4 address."""
    want = cluster.job.interface
    got = probes.parse_interface(sec.body)
    problem = probes.interface_problem(want, got)
    if problem is not None:
        return _r("nic", host, "fail", problem)
    return _r("nic", host, "pass", f"job.interface {want}: {got.ifname} {got.address}/{got.prefixlen}")


def judge_interfaces(per_host: Mapping[str, probes.IfAddr]) -> list[CheckResult]:
    """The interfaces job.interface picked on each host -> warn when they sit in different subnets
    (ranks on one would not reach ranks on another through it)."""
    nets: dict[str, list[str]] = {}
    for h, a in per_host.items():
        net = probes.interface_network(a)
        if net is not None:
            nets.setdefault(net, []).append(h)
    if len(nets) <= 1:
        return []
    parts = "; ".join(f"{net} on {fold(hs)}" for net, hs in sorted(nets.items(), key=lambda kv: -len(kv[1])))
    return [CheckResult("nic", None, "warn", f"job.interface sits in different subnets: {parts}; unless they are "
                        "routed to each other, ranks will not reach each other through it",
                        tuple(h for hs in nets.values() for h in hs))]


def judge_nic_names(per_host: Mapping[str, probes.IfAddr]) -> list[CheckResult]:
    """{host: interface address carrying its inventory address} -> warn when the names differ."""
    named = {h: a for h, a in per_host.items() if a.ifname}
    groups: dict[str, list[str]] = {}
    for h, a in named.items():
        groups.setdefault(a.ifname, []).append(h)  # type: ignore[arg-type]
    if len(groups) <= 1:
        return []
    nets = []
    for a in named.values():
        if a.prefixlen is not None:
            net = str(ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False))
            if net not in nets:
                nets.append(net)
    parts = "; ".join(f"{n} on {fold(hs)}" for n, hs in sorted(groups.items(), key=lambda kv: -len(kv[1])))
    sel = ",".join(nets) if nets else "<subnet>"
    return [CheckResult("nic", None, "warn", f"the hosts' addresses are on differently named interfaces: {parts}; "
                        f"pick the network by subnet instead of name: job.mpirun_args "
                        f"[-mca, btl_tcp_if_include, {sel}, -mca, oob_tcp_if_include, {sel}] "
                        "(NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME per host env for gpu/ascend)",
                        tuple(named))]


def judge_device_ips(cluster: Cluster, hccn: Mapping[str, Mapping[int, probes.HccnDevice] | None]
                     ) -> list[CheckResult]:
    """Device IPs unique across the cluster; each device index on one subnet across hosts (pure)."""
    by_ip: dict[str, list[str]] = {}
    nets: dict[int, dict[str, list[str]]] = {}
    hosts = [h for h in plan_order(cluster.hosts) if h.name in hccn]
    for h in hosts:
        conf = hccn[h.name] or {}
        for d in h.devices:
            dev = conf.get(d)
            ip = h.device_ips.get(d) or (dev.address if dev else None)
            if not ip:
                continue
            by_ip.setdefault(ip, []).append(f"{h.name} device {d}")
            mask = dev.netmask if dev and (d not in h.device_ips or h.device_ips[d] == dev.address) else None
            if mask:
                try:
                    net = str(ipaddress.ip_network(f"{ip}/{mask}", strict=False))
                except ValueError:
                    continue
                nets.setdefault(d, {}).setdefault(net, []).append(h.name)
    out = []
    dups = {ip: where for ip, where in by_ip.items() if len(where) > 1}
    if dups:
        parts = "; ".join(f"{ip} on {', '.join(w)}" for ip, w in list(dups.items())[:10])
        out.append(CheckResult("devices", None, "fail", f"device IPs used twice: {parts}; every device NIC needs "
                               "its own address (fix /etc/hccn.conf or device_ips)", tuple(h.name for h in hosts)))
    split = {d: g for d, g in nets.items() if len(g) > 1}
    for d, groups in sorted(split.items()):
        parts = "; ".join(f"{n} on {fold(hs)}" for n, hs in sorted(groups.items(), key=lambda kv: -len(kv[1])))
        out.append(CheckResult("devices", None, "fail", f"device {d} is on different subnets: {parts}; device {d} "
                               "of every host must share one subnet (HCCL connects same-index devices)",
                               tuple(h for hs in groups.values() for h in hs)))
    return out


def judge_device_rules(cluster: Cluster) -> list[CheckResult]:
    """The plan's rules (Ascend device sets, msrun slots, mpirun env): plan.make_plan must accept it."""
    from .errors import PlanError
    from .plan import make_plan

    try:
        plan = make_plan(cluster)
    except PlanError as exc:
        return [CheckResult("device-rules", None, "fail", str(exc))]
    return [CheckResult("device-rules", None, "pass", f"{len(plan.ranks)} ranks on {len(plan.hosts)} host(s) "
                        "follow the launcher's and platform's device rules")]


def judge_cluster_local(plan: CheckPlan) -> list[CheckResult]:
    """Checks that need no host: the plan's rules, and the files to sync existing here."""
    out: list[CheckResult] = []
    if "device-rules" in plan.checks:
        out += judge_device_rules(plan.cluster)
    if "files" in plan.checks and plan.missing_sync:
        out.append(CheckResult("files", None, "fail", f"job.sync (relative to {plan.cluster.base_dir}): "
                               + "; ".join(plan.missing_sync)))
    return out


def judge_across(plan: CheckPlan, runs: Sequence[ProbeRun]) -> list[CheckResult]:
    """Cluster-wide results from every host's probe output (hosts that gave none are left out)."""
    ok = [r for r in runs if r.sections is not None]
    out: list[CheckResult] = []
    if "versions" in plan.checks:
        per_host = {}
        for r in ok:
            try:
                per_host[r.host.name] = host_versions(r.sections, plan.tools)  # type: ignore[arg-type]
            except (ProbeError, _Missing):
                pass  # already an error result of that host
        out += judge_versions(per_host, plan.tools, plan.needed, plan.cluster.job.launcher)
    if "user" in plan.checks:
        users = {}
        for r in ok:
            s = r.sections.get("user")  # type: ignore[union-attr]
            if s is not None and s.rc == 0 and s.body.strip() and len(s.body.split()) == 1:
                users[r.host.name] = s.body.strip()
        out += judge_users(users, plan.cluster.job.launcher)
    if "nic" in plan.checks:
        carriers = {}
        for r in ok:
            s = r.sections.get("nic")  # type: ignore[union-attr]
            if s is None or not s.finished:
                continue
            try:
                _, a = judge_nic(r.host, s, r.addresses)
            except ProbeError:
                continue
            if a is not None:
                carriers[r.host.name] = a
        out += judge_nic_names(carriers) if not plan.cluster.job.interface else []
        if plan.cluster.job.interface:
            chosen = {}
            for r in ok:
                s = r.sections.get("iface")  # type: ignore[union-attr]
                got = probes.parse_interface(s.body) if s is not None and s.finished else None
                if got is not None:
                    chosen[r.host.name] = got
            out += judge_interfaces(chosen)
    if "clock" in plan.checks and plan.cluster.job.platform == "ascend":
        skews = []
        for r in ok:
            c0, c1 = r.sections.get("clock0"), r.sections.get("clock1")  # type: ignore[union-attr]
            if c0 is not None and c1 is not None and r.t_send and r.t_recv:
                try:
                    skews.append(clock_skew(c0, c1, r.t_send, r.t_recv)[0])
                except ProbeError:
                    pass
        out += judge_hccl_timeout(plan.cluster, skews, [r.t_send for r in ok if r.t_send])
    if "devices" in plan.checks and plan.cluster.job.platform == "ascend":
        confs = {}
        for r in ok:
            s = r.sections.get("hccn")  # type: ignore[union-attr]
            if s is not None and s.finished:
                confs[r.host.name] = probes.parse_hccn(s.body)
        out += judge_device_ips(plan.cluster, confs)
    return out
