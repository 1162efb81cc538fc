"""`orch up`'s prepare step and the launch facts `orch plan` and `orch up` read from the hosts:
one owner for each.

- What must hold on every host before anything is written (`prepare`): who the launch user is
  there (root or not), job.interface there, python3 for the supervisor, and no other live run in
  the workdir. The facts come from one shell script (`prepare_script`, parsed by
  `parse_prepare`); `orch up`'s check probe reads them in its own sections (`sources`, `facts`:
  no round trip of their own), a host the probe did not read is asked now (`ask_prepare`).
- What the launch files need from the hosts (`launch_facts` for up, `plan_facts` for plan):
  device IPs for a rank table (the inventory's, else /etc/hccn.conf) and, for rank table 1.2
  (Atlas A3), every device's super_device_id and the host's super_pod_id (npu-smi).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from . import probes, supervisor
from .devices import HccnDevice, hccn_ips, needs_probe, read_hccn, read_spod, super_devices_for
from .errors import PlanError, PreflightFailed, RunConflict
from .fanout import Results, fan_out
from .launchers import launcher
from .logins import is_root
from .model import Cluster
from .rankplan import RankPlan, device_ips_for
from .sync import Entry, listing_request, listing_script, parse_listing
from .transport import Pool


# --------------------------------------------------------------------------- the facts and their script

PREPARE_FACTS = ("uid", "arch", "interface", "python")  # what prepare reads on every host
LISTING_MARK = "orch:synclist"  # in prepare's own round trip, the sync listing follows this line


def sync_listing(cluster: Cluster, entries: Sequence[Entry]) -> tuple[tuple[str, bool], ...]:
    """What `orch up` lists on every host before it syncs (sync.listing_request, pure): `entries`
    (sync.job_manifest) and the files the launcher renders. Up's check probe lists it (the reach
    test's python3, or a synclist section: reach.lists_sync); with --skip-checks, prepare's round
    trip does: sync then asks no host again."""
    return listing_request(entries, launcher(cluster).rendered_names(cluster))


def prepare_script(cluster: Cluster, launch_address: str = "", read: tuple[str, ...] = PREPARE_FACTS) -> str:
    """One round trip before anything is written: the user id, the machine (uname -m), job.interface
    on this host (if set), python3's version and the run that holds the workdir now (if one does;
    supervisor.python_sh reads both). `read`: the facts to read here (up's probe reads the others
    in the checks' own sections)."""
    lines = ["echo uid $(id -u)"] if "uid" in read else []
    if "arch" in read:
        lines.append("echo arch $(uname -m)")
    if "interface" in read and cluster.job.interface:
        lines.append(probes.interface_script(cluster.job.interface, launch_address))
    if "python" in read:
        lines.append(supervisor.python_sh(supervisor.workdir_facts(cluster)))
    return "\n".join(lines) + "\n"


def parse_prepare(text: str) -> dict[str, Any]:
    """prepare_script's output (or the up probe's sections that read the same facts, joined) ->
    {uid, arch, interface, python, live, agent, share}; None for what the text does not say (python:
    "" when there is no python3; agent: whether this orch's agent package is there, False unsaid)."""
    out: dict[str, Any] = {"uid": None, "python": supervisor.parse_python(text), "live": None, "arch": None,
                           "interface": probes.parse_interface(text), "share": None,
                           "agent": supervisor.AGENT_THERE in text.splitlines()}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        rest = rest.strip()
        if kind == "uid" and rest.isdigit():
            out["uid"] = int(rest)
        elif kind == "live" and rest:
            out["live"] = rest
        elif kind == "arch" and rest:
            out["arch"] = rest
    return out


def sources(plan: Any) -> dict[str, str]:
    """{prepare fact: the section of up's check probe that reads it} (a CheckPlan with prepare):
    each fact read once, by the section that reads it anyway (workdir's uid, nic's iface, path's
    python3, which then reads the workdir's lock as well); the rest in a section `prepare`."""
    job = plan.cluster.job
    return {"uid": "workdir" if "workdir" in plan.checks else "prepare",
            "arch": "prepare",
            "interface": "iface" if job.interface and "nic" in plan.checks else "prepare",
            "python": "path" if "path" in plan.checks else "prepare"}


def probe_facts(plan: Any) -> dict[str, str]:
    """What the check probe's python3 reads of the workdir for prepare (supervisor.facts_env: the
    lock, the agent package), when it reads python3 for prepare (sources): {} in `orch check`.
    Whichever section runs that python3 (path's, or the reach test's) reads these."""
    if not (plan.prepare and sources(plan)["python"] == "path"):
        return {}
    return supervisor.workdir_facts(plan.cluster)


def probe_section(plan: Any) -> list[tuple[str, str]]:
    """The check probe's own `prepare` section: the facts no check's section reads."""
    if not plan.prepare:
        return []
    own = tuple(f for f, where in sources(plan).items() if where == "prepare")
    return [("prepare", prepare_script(plan.cluster, plan.launch.cluster_address, own))]


def facts(plan: Any, sections: Mapping[str, probes.Section] | None) -> dict[str, Any] | None:
    """A host's prepare facts from its check probe's sections, as parse_prepare gives them from
    prepare's own round trip; None when a section they come from is missing or cut off."""
    if sections is None:
        return None
    src = sources(plan)
    bodies = {}
    for name in dict.fromkeys(src.values()):
        s = sections.get(name)
        if s is None or not s.finished:
            return None
        bodies[name] = s.body
    text = bodies["prepare"] + "\n" + bodies.get("path", "")
    reach = sections.get("reach")
    if src["python"] == "path" and supervisor.parse_python(bodies["path"]) is None and reach is not None:
        # a host whose reach test runs python3 read them there (checks/reach.py: tests_by_python)
        if not reach.finished:
            return None
        text += "\n" + reach.body
    out = parse_prepare(text)
    if src["uid"] == "workdir":
        try:
            out["uid"] = probes.parse_workdir(bodies["workdir"]).uid
        except probes.ProbeError:
            return None
    if src["interface"] == "iface":
        out["interface"] = probes.parse_interface(bodies["iface"])
    # the launch host's mesh test left its connections open for mpirun's ssh (checks/mesh.py)
    mesh = sections.get("mesh")
    out["share"] = probes.mesh_shared(mesh.body, plan.share) if plan.share and mesh is not None else None
    return out


# --------------------------------------------------------------------------- the judgement


@dataclass(frozen=True)
class Prepared:
    """What `prepare` learnt from every host."""

    root: dict[str, bool]                           # {host: the launch user is root}
    interfaces: dict[str, tuple[str, str | None]]   # {host: (job.interface there, its IPv4 network)}
    arch: dict[str, str | None] = field(default_factory=dict)  # {host: uname -m}
    addresses: dict[str, str] = field(default_factory=dict)    # {host: its IPv4 address on job.interface}
    live: dict[str, list[str]] = field(default_factory=dict)   # {another run live in the workdir: its hosts} (force)
    listed: dict[str, dict] = field(default_factory=dict)      # {host: what it listed for sync} (the hosts asked here)
    agent: frozenset[str] = frozenset()  # the hosts that have this orch's agent package (supervisor.agent_home)
    share: str | None = None  # the launch host's ControlPath for mpirun's ssh (probes.mesh_shared), if its mesh test left one

    @property
    def aarch64(self) -> bool:
        return any(a == "aarch64" for a in self.arch.values())


def ask_prepare(cluster: Cluster, plan: RankPlan, pool: Pool, hosts: Any,
                listing: Sequence[tuple[str, bool]] = ()) -> Results[tuple[dict[str, Any], dict | None]]:
    """prepare's round trip, one per host of `hosts`: {host: Outcome of (its parsed facts, what it
    listed of `listing`, the sync listing request (sync_listing), or None)}. A listing that failed
    or came back garbled is None (sync asks again); it never hides a fact."""
    script = prepare_script(cluster, plan.launch_host.cluster_address)
    if listing:
        # its failure (no python3: the facts say so) is not the round trip's
        script += f"echo; echo {LISTING_MARK}\n{listing_script(cluster.job.workdir, listing, wrap='')}\ntrue\n"

    def ask(h):
        out = pool[h].run(script).check("preparing the launch").out
        facts_text, mark, listed = out.partition(f"\n{LISTING_MARK}\n")
        return parse_prepare(facts_text), (parse_listing(listing, listed) if mark and listing else None)
    return fan_out(hosts, ask, limit=cluster.ssh.fanout)


def prepare(cluster: Cluster, plan: RankPlan, pool: Pool, *, force: bool = False,
            known: Mapping[str, dict[str, Any]] | None = None, listing: Sequence[tuple[str, bool]] = ()) -> Prepared:
    """What must hold before anything is written (the module's first point). A host it cannot
    use: PreflightFailed (exit 3), as nothing was started; another live run in the workdir:
    RunConflict, unless `force` (the caller stops it: Prepared.live). `known`: {host: its facts}
    as up's check probe read them (checks.Report.prepared); the other hosts are asked now, one
    round trip each, which lists `listing` there too (sync_listing; Prepared.listed)."""
    known = dict(known or {})
    listed: dict[str, dict] = {}
    need = [h for h in plan.all_hosts if h.name not in known]
    if need:
        res = ask_prepare(cluster, plan, pool, need, listing)
        res.raise_if_failed(PreflightFailed, "cannot reach every host; nothing was started")
        known.update({n: f for n, (f, _) in res.succeeded.items()})
        listed = {n: got for n, (_, got) in res.succeeded.items() if got is not None}
    got = {h.name: known[h.name] for h in plan.all_hosts}
    problems = []
    for name, f in got.items():
        problem = supervisor.python_problem(f["python"])
        if problem:
            problems.append(f"{name}: {problem}")
    interfaces: dict[str, tuple[str, str | None]] = {}
    addresses: dict[str, str] = {}
    for name, f in got.items():
        nic = f["interface"]
        problem = probes.interface_problem(cluster.job.interface, nic) if cluster.job.interface else None
        if problem is not None:
            problems.append(f"{name}: job.{problem}")
        elif nic is not None:
            interfaces[name] = (nic.ifname or "", probes.interface_network(nic))
            addresses[name] = nic.address
    if problems:
        raise PreflightFailed("cannot supervise the run; nothing was started:\n" + "\n".join(f"  {p}" for p in problems))
    live: dict[str, list[str]] = {}
    for name, f in got.items():
        if f["live"]:
            live.setdefault(f["live"], []).append(name)
    for run_id, hosts in live.items():
        if not force:
            raise RunConflict(f"run {run_id} is still running on {', '.join(hosts)} (workdir {cluster.job.workdir}); "
                              "a second run there would mix or overwrite its logs",
                              hint=f"stop it with `orch down --run {run_id}` (from the directory that started "
                                   "it), wait for it to end, or pass --force to stop it first")
    return Prepared({n: is_root(uid=f["uid"]) for n, f in got.items()}, interfaces,
                    {n: f["arch"] for n, f in got.items()}, addresses, live, listed,
                    frozenset(n for n, f in got.items() if f.get("agent")), got[plan.launch_host.name].get("share"))


# --------------------------------------------------------------------------- device IPs, super devices


def read_device_ips(plan: RankPlan, pool: Pool, known: Mapping[str, Mapping[int, HccnDevice]] | None = None,
                    *, what: str = "", timeout: float | None = None) -> dict[str, dict[int, str]]:
    """Device IPs for the rank table: the inventory's `device_ips`, else each host's
    /etc/hccn.conf: as `known` has it (what `orch check`'s probe read there), else read now
    (only from hosts that need it, over the pool's connections). PlanError for what is missing
    (`what` goes before a read error's message: `--probe: `)."""
    known = dict(known or {})
    need = [h for h in plan.all_hosts if any(d not in h.device_ips for d in h.devices) and h.name not in known]
    confs = {**known, **(read_hccn(pool, need, what, timeout=timeout) if need else {})}
    return device_ips_for(plan, {n: hccn_ips(c) for n, c in confs.items()})


def read_super_devices(plan: RankPlan, pool: Pool) -> RankPlan:
    """Rank table 1.2 (Atlas A3): the plan with every host's super_device_ids and super_pod_id,
    the inventory's first, else read with npu-smi (`npu-smi info -m`, then `npu-smi info -t
    spod-info -i <card> -c <chip>` per device) on the hosts that need it, over the open
    connections. Anything missing -> PlanError naming host and device (devices.super_devices_for)."""
    need = [h for h in plan.all_hosts if needs_probe(h)]
    outcomes = fan_out(need, lambda h: read_spod(pool[h], h), limit=pool.cluster.ssh.fanout)
    outcomes.raise_if_failed(PlanError, "could not run npu-smi on {n} host(s)", brief=True,
                             hint="run `orch check` for the connection problems, or give super_device_ids and "
                                  "super_pod_id in the inventory")
    return super_devices_for(plan, outcomes.succeeded)


def _a3(cluster: Cluster) -> bool:
    return launcher(cluster).needs_device_ips(cluster) and cluster.job.rank_table_version == "1.2"


def launch_facts(cluster: Cluster, plan: RankPlan, pool: Pool,
                 hccn: Mapping[str, Mapping[int, HccnDevice]] | None = None
                 ) -> tuple[RankPlan, dict[str, dict[int, str]] | None]:
    """`orch up`: (the plan, with Atlas A3's super devices; the device IPs, None when the launcher
    needs none). `hccn`: what the check probe read of each host's hccn.conf (read once per host)."""
    if not launcher(cluster).needs_device_ips(cluster):
        return plan, None
    device_ips = read_device_ips(plan, pool, hccn)
    return (read_super_devices(plan, pool) if _a3(cluster) else plan), device_ips


@dataclass(frozen=True)
class PlanFacts:
    """`orch plan`'s launch facts: the plan (A3: with super devices, or placeholders for the shown
    commands when some are missing), the device IPs (None: no rank table can be shown) and why
    the rank table cannot be shown (`missing`), when it cannot."""

    plan: RankPlan
    device_ips: dict[str, dict[int, str]] | None
    missing: PlanError | None


def plan_facts(cluster: Cluster, plan: RankPlan, *, probe: bool, pool: Callable[[], Pool]) -> PlanFacts:
    """`orch plan`: the inventory's device IPs and super devices; with `probe`, what it lacks read
    on the hosts as `orch up` reads it (over one `pool()`: one connection per host for both
    reads), where a missing fact is a PlanError; without, it is `missing` (the plan is shown all
    the same)."""
    if not probe:
        return _plan_facts(cluster, plan, None)
    with pool() as p:   # connects only to the hosts it reads
        return _plan_facts(cluster, plan, p)


def _plan_facts(cluster: Cluster, plan: RankPlan, pool: Pool | None) -> PlanFacts:
    device_ips: dict[str, dict[int, str]] | None = None
    missing: PlanError | None = None
    if launcher(cluster).needs_device_ips(cluster):
        try:
            if pool is not None:  # /etc/hccn.conf of the hosts whose inventory lacks some, as `orch up` reads it
                device_ips = read_device_ips(plan, pool, what="--probe: ",
                                             timeout=cluster.ssh.connect_timeout + cluster.ssh.command_timeout)
            else:
                device_ips = device_ips_for(plan, {})
        except PlanError as exc:
            if pool is not None:
                raise
            missing = exc
    if _a3(cluster):
        plan, missing_sdids = _plan_super_devices(plan, pool)
        if missing_sdids is not None:  # no rank table without them; the commands show placeholders
            device_ips = None
            missing = missing_sdids if missing is None else \
                PlanError(f"{missing.message}\n{missing_sdids.message}", hint=missing_sdids.hint)
    return PlanFacts(plan, device_ips, missing)


def _plan_super_devices(plan: RankPlan, pool: Pool | None) -> tuple[RankPlan, PlanError | None]:
    """Rank table 1.2: (the plan with every host's super devices, None), read with npu-smi where the
    inventory lacks them when probing (`pool`); or, when some are missing without it, (the plan
    with placeholders for the printed commands, the PlanError)."""
    if pool is not None and any(needs_probe(h) for h in plan.all_hosts):
        return read_super_devices(plan, pool), None
    try:
        return super_devices_for(plan, {}), None
    except PlanError as exc:
        if pool is not None:
            raise
        n = iter(range(sum(len(h.devices) for h in plan.all_hosts)))
        shown = tuple(replace(h, super_device_ids={d: next(n) for d in h.devices}, super_pod_id=0)
                      for h in plan.all_hosts)
        return replace(plan, hosts=shown[:len(plan.hosts)], spares=shown[len(plan.hosts):]), exc
