"""Pure: a validated Cluster -> a RankPlan (which rank runs on which host and device).

No I/O here: `orch plan` and `orch up` both call `make_plan`, and every launcher
(mpirun, ranktable, msrun) renders from the same plan, so they agree on who is
rank N.

The host order (ONE order for every launcher)
---------------------------------------------
Hosts are sorted by their server_id, which is the host's `address`:

1. IP addresses first, compared numerically (`ipaddress`): every IPv4 address
   before every IPv6 address, so 10.0.0.2 < 10.0.0.10 (a string sort would
   put 10.0.0.10 first);
2. then DNS names, compared as plain strings (lexicographically; `node10`
   sorts before `node9`, so zero-pad numbered names: node[01-16]).

Atlas A3 (rank table 1.2): when the inventory gives every host a `super_pod_id`,
hosts are grouped by it first (`by_super_pod`), as HCCL lists one SuperPoD's
servers after another's.

The sort is stable: hosts with the same address (possible with different ports
or `connection: local`) keep their inventory order. Ranks are contiguous per
host: the first host gets ranks 0..slots-1, the next one continues, and so on.
On a host, local rank i runs on the i-th entry of `host.devices` (default
0..slots-1). This is HCCL's rule for rank tables (servers ordered by server_id,
rank ids contiguous per server), mpirun's default by-slot mapping of a
hostfile written in this order, and msrun's `rank = node_rank * L + local`.
The launch host (mpirun's host, msrun's master) is the FIRST host of the plan
(not necessarily the first host of the inventory).

Validation collects every violation into one PlanError (exit code 2):
- platform ascend (skippable with `checks.skip: [device-rules]`, which turns
  the violations into a loud warning in `plan.warnings`):
  one host: 1, 2, 4 or 8 devices; several hosts: 8 devices per host (8 x N);
  a 2- or 4-device set lies inside {0,1,2,3} or {4,5,6,7}; device ids 0..7.
  With rank table version 1.2 (Atlas A3) instead `ascend_a3_violations`: ids
  0..15, whole NPUs (dies 2k and 2k+1 together), 1 or an even count up to 16
  per host, the same count on every host of a multi-host job.
- launcher msrun: the same slots on every host (msrun's rank formula needs it).
- launcher mpirun: one mpirun exports one environment to every rank, so a
  device selection (CUDA_/ASCEND_RT_VISIBLE_DEVICES) and each host `env`
  variable must be the same on every host.
- launcher ranktable: server_ids (addresses) must be unique.
- no duplicate devices on a host.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from . import sh
from .devices import HCCN_CONF
from .errors import PlanError
from .hostsets import by_value
from .model import Cluster, Host

ASCEND_MAX_DEVICE = 7
ASCEND_NETWORKS = (frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7}))
SINGLE_HOST_ASCEND_SIZES = (1, 2, 4, 8)

RULE_SINGLE = ("Ascend rule (HCCL): a single-host job uses 1, 2, 4 or 8 devices")
RULE_MULTI = ("Ascend rule (HCCL): a multi-host job uses 8 devices on every host (8 x N)")
RULE_NETWORK = ("Ascend rule (HCCL): devices 0-3 and 4-7 are two separate networks; a 2- or 4-device job "
                "must lie inside {0,1,2,3} or {4,5,6,7} ({0,4} is not allowed, {1,2} is)")
RULE_IDS = "Ascend rule: device ids are 0..7"


@dataclass(frozen=True, slots=True)
class Rank:
    rank: int
    host: str        # host name
    address: str     # host address (= server_id in rank tables)
    local_rank: int
    device_id: int   # physical device id

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "address": self.address,
                "local_rank": self.local_rank, "device_id": self.device_id}


@dataclass(frozen=True)
class RankPlan:
    """Who runs which rank where. `hosts` and `ranks` are in plan order (see module doc)."""

    ranks: tuple[Rank, ...]
    hosts: tuple[Host, ...]
    launcher: str = "mpirun"
    platform: str = "cpu"
    warnings: tuple[str, ...] = ()
    spares: tuple[Host, ...] = ()   # hosts with no ranks, in inventory order: each can take a lost host's place
    _index: Mapping[str, tuple[int, int, int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self._index:
            index: dict[str, tuple[int, int, int]] = {}
            start = 0
            for i, h in enumerate(self.hosts):
                index[h.name] = (i, start, start + h.slots)
                start += h.slots
            object.__setattr__(self, "_index", index)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def launch_host(self) -> Host:
        return self.hosts[0]

    @property
    def all_hosts(self) -> tuple[Host, ...]:
        """The hosts that run ranks, then the spares: every host orch checks, syncs and supervises."""
        return self.hosts + self.spares

    def can_replace(self, name: str, spare: Host) -> bool:
        """May `spare` take host `name`'s place: not the launch host (the run's head lives there),
        and the same devices (its ranks keep their DEVICE_ID)."""
        return fits(self.launch_host, self.host(name), spare)

    def host(self, name: str) -> Host:
        return self.hosts[self._lookup(name)[0]]

    def node_rank(self, name: str) -> int:
        """Index of the host in plan order (msrun's --node_rank)."""
        return self._lookup(name)[0]

    def by_host(self, name: str) -> tuple[Rank, ...]:
        _, start, stop = self._lookup(name)
        return self.ranks[start:stop]

    def _lookup(self, name: str) -> tuple[int, int, int]:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"host {name!r} is not in the plan") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "launcher": self.launcher,
            "platform": self.platform,
            "size": self.size,
            "launch_host": self.launch_host.name,
            "hosts": [{"name": h.name, "address": h.address, "slots": h.slots, "devices": list(h.devices),
                       "node_rank": i, "first_rank": self._index[h.name][1]}
                      for i, h in enumerate(self.hosts)],
            "ranks": [r.to_dict() for r in self.ranks],
            "warnings": list(self.warnings),
            **({"spares": [{"name": h.name, "address": h.address, "devices": list(h.devices)} for h in self.spares]}
               if self.spares else {}),
        }


def ranks_by_host(plan: RankPlan, replacements: Sequence[Mapping[str, Any]] = ()) -> dict[str, list[int]]:
    """{host: the ranks it ran in any attempt}: the planned hosts' own, and each spare that took a
    lost host's place (the head's `replaced` records, in order: {"host", "by", ...}) that host's."""
    out = {h.name: [r.rank for r in plan.by_host(h.name)] for h in plan.hosts}
    for rec in replacements:
        out[rec["by"]] = sorted(set(out.get(rec["by"], [])) | set(out.get(rec["host"], [])))
    return out


def current_hosts(plan: RankPlan, replacements: Sequence[Mapping[str, Any]] = ()) -> dict[int, str]:
    """{rank: the host that runs it now} (after the replacements, in order)."""
    now = {r.rank: r.host for r in plan.ranks}
    for rec in replacements:
        now = {k: rec["by"] if h == rec["host"] else h for k, h in now.items()}
    return now


def replaced(plan: RankPlan, swaps: Mapping[str, str]) -> RankPlan:
    """The plan with host OLD's ranks on spare NEW for each OLD -> NEW of `swaps`: same rank
    count, same rank order, same local ranks and device ids; the spare takes its place in the
    host order (what the head renders on the cluster when it replaces a lost host)."""
    spares = {h.name: h for h in plan.spares}
    unknown = [n for n in swaps.values() if n not in spares]
    if unknown:
        raise KeyError(f"not a spare of the plan: {', '.join(unknown)}")
    hosts = list(plan.hosts)
    ranks = list(plan.ranks)
    index = dict(plan._index)
    for old, new in swaps.items():   # only the swapped hosts' ranks change (orch up renders one per spare and host)
        i, start, stop = index.pop(old)
        spare = replace(spares[new], spare=False)
        hosts[i] = spare
        index[new] = (i, start, stop)
        ranks[start:stop] = [replace(r, host=new, address=spare.cluster_address) for r in ranks[start:stop]]
    used = set(swaps.values())
    return RankPlan(ranks=tuple(ranks), hosts=tuple(hosts), launcher=plan.launcher, platform=plan.platform,
                    warnings=plan.warnings, spares=tuple(h for h in plan.spares if h.name not in used), _index=index)


# --------------------------------------------------------------------------- ordering


def server_key(address: str) -> tuple[int, int, int, str]:
    """Sort key of a host address: IPv4 (numeric) < IPv6 (numeric) < DNS names (lexicographic)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return (1, 0, 0, address)
    return (0, ip.version, int(ip), "")


def order_hosts(hosts: Iterable[Host]) -> tuple[Host, ...]:
    return by_super_pod(tuple(sorted(hosts, key=lambda h: server_key(h.cluster_address))))


def by_super_pod(hosts: tuple[Host, ...]) -> tuple[Host, ...]:
    """Atlas A3: when the inventory gives every host its super_pod_id, each SuperPoD's hosts
    together (HCCL's rank table 1.2 lists one SuperPoD's servers after another's), SuperPoDs
    by id, hosts by address inside each. Otherwise the order is unchanged."""
    if not hosts or any(h.super_pod_id is None for h in hosts):
        return hosts
    return tuple(sorted(hosts, key=lambda h: h.super_pod_id or 0))  # every one has an id (above)


# --------------------------------------------------------------------------- the plan


def make_plan(cluster: Cluster) -> RankPlan:
    """Lay out ranks on the cluster's hosts. Raises PlanError listing every violated rule."""
    job = cluster.job
    hosts = order_hosts(h for h in cluster.hosts if not h.spare)
    spares = tuple(h for h in cluster.hosts if h.spare)
    if not hosts:
        raise PlanError("no hosts to plan on" + (" (every host is a spare)" if spares else ""),
                        hint="check the inventory and the --hosts pattern")

    errors: list[str] = []
    warnings: list[str] = []
    for h in hosts:
        if len(set(h.devices)) != len(h.devices):
            errors.append(f"host {h.name}: devices {list(h.devices)} repeat an id; each device runs one rank")
        if len(h.devices) != h.slots:
            errors.append(f"host {h.name}: {len(h.devices)} devices for {h.slots} slots; they must match")

    if job.platform == "ascend":
        violations = ascend_a3_violations(hosts) if job.rank_table_version == "1.2" else ascend_violations(hosts)
        if violations and "device-rules" in cluster.checks.skip:
            warnings.append("WARNING: device-rules is skipped (checks.skip), but this plan breaks the Ascend "
                            "device rules; HCCL will most likely refuse to build the communicator:\n"
                            + "\n".join(f"  - {v}" for v in violations))
        else:
            errors.extend(violations)

    if job.launcher in ("msrun", "torchrun"):
        slots = {h.slots for h in hosts}
        if len(slots) > 1:
            errors.append(f"{job.launcher} rule: every host runs the same number of ranks (global rank = node "
                          "rank * ranks per node + local index); slots here: " + _describe_by(hosts, lambda h: h.slots))

    if job.launcher == "mpirun":
        errors.extend(mpirun_violations(hosts + spares, job.platform))

    errors.extend(spare_violations(hosts, spares))

    if job.launcher == "ranktable":
        seen: dict[str, str] = {}
        for h in hosts + spares:
            if h.cluster_address in seen:
                errors.append(f"rank table rule: server_id (the host address) identifies a server; hosts "
                              f"{seen[h.cluster_address]} and {h.name} share address {h.cluster_address}")
            else:
                seen[h.cluster_address] = h.name

    if errors:
        raise PlanError("impossible plan:\n" + "\n".join(f"  - {e}" for e in errors),
                        hint=_hint(errors))

    ranks: list[Rank] = []
    n = 0
    for h in hosts:
        name, address = h.name, h.cluster_address
        for local, dev in enumerate(h.devices):
            ranks.append(Rank(n, name, address, local, dev))
            n += 1
    return RankPlan(ranks=tuple(ranks), hosts=hosts, launcher=job.launcher, platform=job.platform,
                    warnings=tuple(warnings), spares=spares)


def fits(launch: Host, host: Host, spare: Host) -> bool:
    """The one rule for who may take whose place: never the launch host (the run's head lives
    there), and only with the same devices (the ranks keep their DEVICE_ID on the spare)."""
    return host.name != launch.name and host.devices == spare.devices


def spare_violations(hosts: tuple[Host, ...], spares: tuple[Host, ...]) -> list[str]:
    """A spare must fit (`fits`) at least one host that runs ranks."""
    out = []
    for s in spares:
        if len(hosts) == 1:
            out.append(f"spare {s.name}: there is no host it could replace (the launch host {hosts[0].name}, "
                       "where the run's supervisor decides, is never replaced)")
        elif not any(fits(hosts[0], h, s) for h in hosts):
            out.append(f"spare {s.name}: devices {list(s.devices)} match no host that runs ranks (its ranks keep "
                       f"their DEVICE_ID on the spare); hosts have " + _describe_by(hosts[1:], lambda h: ",".join(map(str, h.devices))))
    return out


def _hint(errors: list[str]) -> str | None:
    if any(e.startswith("Ascend rule") for e in errors):
        return ("choose devices that follow the rules (inventory: slots / devices), or add device-rules to "
                "checks.skip to try anyway")
    return None


def ascend_violations(hosts: tuple[Host, ...]) -> list[str]:
    """The Ascend device rules of the seeds (HCCL), one message per violation."""
    out: list[str] = []
    for h in hosts:
        bad = [d for d in h.devices if d > ASCEND_MAX_DEVICE or d < 0]
        if bad:
            out.append(f"{RULE_IDS}; host {h.name} lists {bad}")
    if len(hosts) == 1:
        h = hosts[0]
        n = len(h.devices)
        if n not in SINGLE_HOST_ASCEND_SIZES:
            out.append(f"{RULE_SINGLE}; host {h.name} has {n} ({_devs(h)})")
        elif n in (2, 4) and not any(set(h.devices) <= net for net in ASCEND_NETWORKS):
            out.append(f"{RULE_NETWORK}; host {h.name} uses {_devs(h)}")
    else:
        wrong = [h for h in hosts if len(h.devices) != 8]
        if wrong:
            out.append(f"{RULE_MULTI}; {len(hosts)} hosts, these do not have 8: "
                       + _describe_by(wrong, lambda h: len(h.devices)))
    return out


A3_MAX_DEVICE = 15      # Atlas A3: 8 NPUs of two dies each, every die a device (a rank)
A3_DIES_PER_NPU = 2
A3_HOST_SIZES = (1, 2, 4, 6, 8, 10, 12, 14, 16)
RULE_A3_IDS = "Ascend rule (Atlas A3): device ids are 0..15 (8 NPUs of two dies)"
RULE_A3_SINGLE = ("Ascend rule (Atlas A3): a single-host job uses 1 device or an even number of devices "
                  "(2, 4, ..., 16)")
RULE_A3_MULTI = ("Ascend rule (Atlas A3): a multi-host job uses the same even number of devices (2, 4, ..., 16) "
                 "on every host")
RULE_A3_NPU = ("Ascend rule (Atlas A3): the two dies of an NPU (devices 2k and 2k+1) belong to the job together "
               "when it uses more than one device")


def ascend_a3_violations(hosts: tuple[Host, ...]) -> list[str]:
    """The device rules of Atlas A3 (rank table 1.2), one message per violation. The 0-3/4-7
    networks of the 8-device servers do not exist here: the 16 dies are one HCCS network."""
    out: list[str] = []
    for h in hosts:
        bad = [d for d in h.devices if d > A3_MAX_DEVICE or d < 0]
        if bad:
            out.append(f"{RULE_A3_IDS}; host {h.name} lists {bad}")
    counts = {len(h.devices) for h in hosts}
    if len(hosts) == 1:
        h = hosts[0]
        if len(h.devices) not in A3_HOST_SIZES:
            out.append(f"{RULE_A3_SINGLE}; host {h.name} has {len(h.devices)} ({_devs(h)})")
    else:
        wrong = [h for h in hosts if len(h.devices) not in A3_HOST_SIZES[1:]]
        if wrong or len(counts) > 1:
            out.append(f"{RULE_A3_MULTI}; {len(hosts)} hosts, devices per host: "
                       + _describe_by(hosts, lambda h: len(h.devices)))
    halves = [h for h in hosts if len(h.devices) > 1
              and any(d ^ 1 not in h.devices for d in h.devices if 0 <= d <= A3_MAX_DEVICE)]
    for h in halves:
        lone = sorted(d for d in h.devices if 0 <= d <= A3_MAX_DEVICE and d ^ 1 not in h.devices)
        out.append(f"{RULE_A3_NPU}; host {h.name} uses {lone} without "
                   f"{sorted(d ^ 1 for d in lone)}")
    return out


def mpirun_violations(hosts: tuple[Host, ...], platform: str) -> list[str]:
    out: list[str] = []
    if platform in ("gpu", "ascend") and any(not _default_devices(h) for h in hosts):
        if len({h.devices for h in hosts}) > 1:
            var = visible_devices_var(platform)
            out.append(f"mpirun rule: mpirun exports ONE {var} to every rank, so a device selection other "
                       f"than 0..slots-1 must be the same on every host; devices here: "
                       + _describe_by(hosts, lambda h: ",".join(map(str, h.devices))))
    ssh = [h for h in hosts[1:] if h.connection == "ssh"]
    if len({(h.port, h.user) for h in ssh}) > 1:
        out.append("mpirun rule: mpirun logs in to every other host with one ssh port and user (plm_rsh_args), "
                   "but they differ: " + _describe_by(ssh, lambda h: f"{h.user}:{h.port}")
                   + "; use the same port and user on every host, or launcher msrun/ranktable")
    names = sorted({k for h in hosts for k in h.env})
    for k in names:
        values = {h.env.get(k) for h in hosts}
        if len(values) > 1:
            out.append(f"mpirun rule: mpirun exports ONE environment to every rank, but host env {k} differs: "
                       + _describe_by(hosts, lambda h, k=k: sh.shown(h.env.get(k, "<unset>")))
                       + "; give it the same value on every host (inventory defaults.env), set it in each "
                       "host's login environment, or use launcher msrun/ranktable (one launch per host)")
    return out


def visible_devices_var(platform: str) -> str:
    return "ASCEND_RT_VISIBLE_DEVICES" if platform == "ascend" else "CUDA_VISIBLE_DEVICES"


def _default_devices(h: Host) -> bool:
    return h.devices == tuple(range(len(h.devices)))


def _devs(h: Host) -> str:
    return "{" + ",".join(map(str, h.devices)) + "}"


def _describe_by(hosts: Iterable[Host], key: Callable[..., Hashable], limit: int = 8) -> str:
    """Group hosts by a value and fold their names: 'node[01-04]: 8; node05: 4'."""
    parts = [f"{names}: {value}" for value, names in by_value((h.name, key(h)) for h in hosts)]
    if len(parts) > limit:
        parts = parts[:limit] + [f"... ({len(parts) - limit} more)"]
    return "; ".join(parts)


# --------------------------------------------------------------------------- device IPs (ascend)

def device_ips_for(plan: RankPlan, probed: Mapping[str, Mapping[int, str]]) -> dict[str, dict[int, str]]:
    """{host name: {device id: device IP}} for every device in the plan.

    The inventory's `device_ips` come first; otherwise the values probed from the host's
    /etc/hccn.conf (`probed[host name]`). Anything missing or malformed -> PlanError
    naming each host and device and how to fix it."""
    out: dict[str, dict[int, str]] = {}
    missing: list[str] = []
    bad: list[str] = []
    for h in plan.all_hosts:
        found = probed.get(h.name)
        ips: dict[int, str] = {}
        lacking: list[int] = []
        for d in h.devices:
            ip = h.device_ips.get(d)
            if ip is None and found is not None:
                ip = found.get(d)
            if ip is None:
                lacking.append(d)
                continue
            try:
                ipaddress.ip_address(str(ip))
            except ValueError:
                bad.append(f"host {h.name} device {d}: device IP {ip!r} is not an IP address")
                continue
            ips[d] = str(ip)
        if lacking:
            where = (f"{HCCN_CONF} was not read (run with --probe)" if found is None else
                     f"not in its {HCCN_CONF} either")
            missing.append(f"host {h.name} devices {lacking}: no device IP in the inventory's device_ips, "
                           f"{where}")
        out[h.name] = ips
    if missing or bad:
        lines = bad + missing
        shown = lines[:20] + ([f"... and {len(lines) - 20} more hosts"] if len(lines) > 20 else [])
        raise PlanError(
            "the rank table needs the IP of every device's NIC:\n" + "\n".join(f"  - {s}" for s in shown),
            hint=("add them to the inventory (device_ips: {0: 192.168.100.101, ...} on the host), or make "
                  f"sure {HCCN_CONF} on the host has address_<device id>=IP lines "
                  "(hccn_tool -i <id> -ip -s address <ip> netmask <mask>)"))
    return out
