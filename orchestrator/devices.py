"""Device facts, each parsed in one place: /etc/hccn.conf (every Ascend host's device NIC
addresses, for `orch check`, `orch plan --probe` and the rank table of `orch up`), and for
Atlas A3 (SuperPoD, HCCL rank table 1.2) npu-smi's output, and each host's super device ids
resolved.

    /etc/hccn.conf    address_<id>=IP and netmask_<id>=MASK lines (written by hccn_tool):
                      parse_hccn -> {device: HccnDevice}; hccn_ips -> {device: IP}

A "1.2" rank table gives every device its `super_device_id` (the die's id inside the
SuperPoD, which HCCL compares with what the driver reports) and groups the servers by
`super_pod_id`. Both come from the inventory (`super_device_ids: {device: id}` and
`super_pod_id: N` on a host or in defaults) or, where the inventory is silent, from the
host itself:

    npu-smi info -m                              which NPU (card) and chip each device is
    npu-smi info -t spod-info -i <card> -c <chip>   prints SDID, Super Pod Size, Super Pod ID,
                                                  Server Index ("\\t%-30s : %u" lines)

Device ids in orch (and `device_id` in the rank table) are physical ids: the `Chip Phy-ID`
column of `npu-smi info -m`. An A3 NPU holds two dies, chips 0 and 1, so a server has 16
devices; `-m` maps each physical id to its (NPU ID, Chip ID). When `-m` prints no Phy-ID
column, orch assumes the usual numbering: device d is die d % 2 of NPU d // 2
(`a3_card_chip`).

Everything here is pure except `read_hccn` and `read_spod`, which run their commands through a
transport. `super_devices_for` merges inventory and probed values into the plan's hosts and
refuses, naming host and device, anything HCCL's RanktableCheck would refuse: a missing or
empty super_device_id, one id twice in a SuperPoD, a host whose dies disagree on the
SuperPoD, a SuperPoD whose servers are not listed together.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .errors import PlanError
from .hostsets import fold
from .model import Host
from .fanout import fan_out

if TYPE_CHECKING:  # rankplan.py imports this module
    from .rankplan import RankPlan
    from .transport import Pool
    from .transport.base import Transport

HCCN_CONF = "/etc/hccn.conf"
NPU_SMI = "npu-smi"
MAPPING_ARGV = (NPU_SMI, "info", "-m")
DIES_PER_NPU = 2
MAX_SUPER_DEVICE_ID = 2 ** 32 - 1   # npu-smi prints the SDID as an unsigned 32-bit integer
SECTION = "@@orch:spod"


def spod_argv(card: int, chip: int) -> list[str]:
    """The query of one die's SuperPoD facts."""
    return [NPU_SMI, "info", "-t", "spod-info", "-i", str(card), "-c", str(chip)]


# --------------------------------------------------------------------------- hccn.conf


@dataclass(frozen=True)
class HccnDevice:
    """One device's lines in /etc/hccn.conf (None: the file has no such line)."""

    address: str | None
    netmask: str | None


_HCCN_LINE = re.compile(r"^\s*(address|netmask)_(\d+)\s*=\s*([^\s#]+)")


def parse_hccn(text: str) -> dict[int, HccnDevice]:
    """/etc/hccn.conf text -> {device id: HccnDevice} from its `address_<id>=` and `netmask_<id>=`
    lines. gateway_/netdetect_ lines, comments, blanks and garbage are ignored; spaces around
    '=' and CRLF line ends are tolerated; a repeated id keeps the last value (what hccn_tool
    would have written last). Values are kept as written (hccn_ips keeps the IP addresses)."""
    addr: dict[int, str] = {}
    mask: dict[int, str] = {}
    for line in text.splitlines():
        m = _HCCN_LINE.match(line)
        if m:
            (addr if m.group(1) == "address" else mask)[int(m.group(2))] = m.group(3)
    return {d: HccnDevice(addr.get(d), mask.get(d)) for d in sorted(set(addr) | set(mask))}


def hccn_ips(conf: Mapping[int, HccnDevice]) -> dict[int, str]:
    """{device id: device NIC IP} from a parsed hccn.conf: only addresses that are IP addresses."""
    out: dict[int, str] = {}
    for d, dev in conf.items():
        if dev.address is None:
            continue
        try:
            ipaddress.ip_address(dev.address)
        except ValueError:
            continue
        out[d] = dev.address
    return out


def read_hccn(pool: Pool, hosts: Sequence[Host], what: str = "", timeout: float | None = None
              ) -> dict[str, dict[int, HccnDevice]]:
    """Each host's /etc/hccn.conf, over the pool's connections (at once, up to ssh.fanout):
    {host name: parse_hccn}. A host it cannot read from -> PlanError naming them all (`what`
    goes before the message: `--probe: `)."""

    def read(h: Host) -> dict[int, HccnDevice]:
        return parse_hccn(pool[h].run(["cat", HCCN_CONF]).check(f"reading {HCCN_CONF}").out)

    res = fan_out(hosts, read, limit=pool.cluster.ssh.fanout, timeout=timeout)
    res.raise_if_failed(PlanError, f"{what}could not read {HCCN_CONF} on {{n}} host(s)", brief=True,
                        hint="run `orch check` for the connection problems, or give device_ips in the inventory")
    return res.succeeded


# --------------------------------------------------------------------------- npu-smi parsers


@dataclass(frozen=True)
class SpodInfo:
    """`npu-smi info -t spod-info -i <card> -c <chip>` of one die. None: not printed (or not a number)."""

    sdid: int | None
    super_pod_id: int | None
    super_pod_size: int | None = None
    server_index: int | None = None
    output: str = ""   # what npu-smi printed, for error messages
    query: str = ""    # the command that printed it


_SPOD_KEYS = {"sdid": "sdid", "super pod id": "super_pod_id", "super pod size": "super_pod_size",
              "server index": "server_index"}
_SPOD_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z ]*?)\s*:\s*(\S*)\s*$")


def parse_spod_info(text: str) -> SpodInfo:
    """spod-info output -> SpodInfo. Keys are matched without regard to case or padding (npu-smi
    pads them to 30 columns after a tab; documentation shows them unpadded); a value that is not
    a decimal number is None, like a key that is missing. Other lines are ignored."""
    found: dict[str, int | None] = {}
    for line in text.splitlines():
        m = _SPOD_LINE.match(line)
        if not m:
            continue
        key = _SPOD_KEYS.get(" ".join(m.group(1).lower().split()))
        if key is None or key in found:
            continue
        value = m.group(2)
        found[key] = int(value) if value.isdigit() and int(value) <= MAX_SUPER_DEVICE_ID else None
    values: dict[str, Any] = {k: found.get(k) for k in _SPOD_KEYS.values()}
    return SpodInfo(output=text, **values)


_MAPPING_HEADER = re.compile(r"^\s*NPU ID\s+Chip ID\s+Chip Logic ID\s+Chip Phy-ID\s+Chip Name\b")
_MAPPING_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+|-)\s+(\d+|-)\s+\S")


def parse_npu_mapping(text: str) -> dict[int, tuple[int, int]]:
    """`npu-smi info -m` -> {chip physical id: (NPU ID, Chip ID)}.

    Only the A3 layout (NPU ID, Chip ID, Chip Logic ID, Chip Phy-ID, Chip Name) names physical
    ids; any other output (older npu-smi, other chips, an error) gives {} and the caller falls
    back to `a3_card_chip`. Rows without a physical id (the Mcu of each NPU) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _MAPPING_HEADER.match(line)), None)
    if start is None:
        return {}
    out: dict[int, tuple[int, int]] = {}
    for line in lines[start + 1:]:
        m = _MAPPING_ROW.match(line)
        if m and m.group(4) != "-":
            out.setdefault(int(m.group(4)), (int(m.group(1)), int(m.group(2))))
    return out


_A3_TABLE = re.compile(r"^\|\s*Chip\s+Phy-ID\s*\|", re.M)
NPU_ROW = re.compile(r"^\|\s*(\d+)\s+\S.*?\|\s*([A-Za-z][A-Za-z ]*?)\s*\|")   # | NPU  Name | Health |
_CHIP_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s*\|")                               # | Chip  Phy-ID | Bus-Id |


def parse_npu_smi_dies(text: str) -> dict[int, str] | None:
    """`npu-smi info` of an A3 server -> {device (the die's Chip Phy-ID): health ('OK', 'Warning'...)};
    None when the table is not the A3 layout (its second header line is `| Chip  Phy-ID |`). On A3
    every die has two rows: `| NPU  Name | Health | ...` then `| Chip  Phy-ID | Bus-Id | ...`, so
    the NPU ids of the first rows (0..7) are cards, not the 16 device ids a job names."""
    if not _A3_TABLE.search(text):
        return None
    out: dict[int, str] = {}
    health = None
    for line in text.splitlines():
        if "Process id" in line:
            break
        m = _CHIP_ROW.match(line)
        if m and health is not None:
            out[int(m.group(2))] = health
            health = None
            continue
        m = NPU_ROW.match(line)
        if m:
            health = m.group(2)
    return out


def a3_card_chip(device: int) -> tuple[int, int]:
    """The assumed (NPU ID, Chip ID) of A3 device `device` when `npu-smi info -m` does not say:
    two dies per NPU, numbered NPU by NPU (devices 0 and 1 are NPU 0's chips 0 and 1)."""
    return device // DIES_PER_NPU, device % DIES_PER_NPU


def card_chip(device: int, mapping: Mapping[int, tuple[int, int]]) -> tuple[int, int]:
    return mapping.get(device) or a3_card_chip(device)


def spod_script(targets: Sequence[tuple[int, int, int]]) -> str:
    """One sh snippet querying spod-info for each (device, card, chip), every answer in its own
    section: `@@orch:spod <device>` then npu-smi's stdout and stderr."""
    parts = []
    for device, card, chip in targets:
        parts.append(f"echo {shlex.quote(f'{SECTION} {device}')}; "
                     f"{shlex.join(spod_argv(card, chip))} 2>&1")
    return "; ".join(parts) + ("; true" if parts else "true")


def parse_spod_sections(text: str) -> dict[int, SpodInfo]:
    """spod_script's output -> {device: SpodInfo}."""
    out: dict[int, SpodInfo] = {}
    device: int | None = None
    body: list[str] = []
    for line in text.splitlines() + [f"{SECTION} -1"]:
        m = re.fullmatch(rf"{re.escape(SECTION)} (-?\d+)\s*", line)
        if not m:
            body.append(line)
            continue
        if device is not None:
            out[device] = parse_spod_info("\n".join(body))
        device, body = int(m.group(1)), []
    return out


# --------------------------------------------------------------------------- reading a host


def needs_probe(h: Host) -> bool:
    """Does the inventory leave anything of the host's super devices to read on the host?"""
    return h.super_pod_id is None or any(d not in h.super_device_ids for d in h.devices)


def read_spod(transport: Transport, h: Host) -> dict[int, SpodInfo]:
    """{device: SpodInfo} read on the host (through `transport`, two commands) for the devices
    whose super_device_id the inventory lacks; for its first device when only super_pod_id is
    lacking. Each SpodInfo carries its query, for error messages."""
    wanted = [d for d in h.devices if d not in h.super_device_ids] or list(h.devices[:1])
    mapping = parse_npu_mapping(transport.run(list(MAPPING_ARGV)).out)
    where = {d: card_chip(d, mapping) for d in wanted}
    res = transport.run(spod_script([(d, *where[d]) for d in wanted]))
    found = parse_spod_sections(res.out)
    return {d: replace(found.get(d) or SpodInfo(None, None, output=res.out + res.err),
                       query=shlex.join(spod_argv(*where[d]))) for d in wanted}


# --------------------------------------------------------------------------- resolving


def super_devices_for(plan: RankPlan, probed: Mapping[str, Mapping[int, SpodInfo]]) -> RankPlan:
    """The plan with every host's super_device_ids and super_pod_id complete: the inventory's
    first, then what npu-smi printed on the host (`probed[host name]`). Anything missing or
    that HCCL would refuse -> PlanError naming each host and device."""
    hosts: list[Host] = []
    problems: list[str] = []
    for h in plan.all_hosts:
        got = probed.get(h.name)
        ids = dict(h.super_device_ids)
        lacking = []
        reasons: dict[str, list[int]] = {}
        queries: dict[str, str] = {}
        for d in h.devices:
            if d in ids:
                continue
            info = got.get(d) if got is not None else None
            if info is None or info.sdid is None:
                lacking.append(d)
                why = ("npu-smi was not asked (run `orch plan --probe`)" if got is None else
                       "npu-smi was not asked" if info is None else f"printed no SDID: {_quote(info.output)}")
                reasons.setdefault(why, []).append(d)
                queries.setdefault(why, info.query if info is not None else "")
                continue
            ids[d] = info.sdid
        for why, devs in reasons.items():
            if why.startswith("printed"):  # the same answer for several devices: the first query stands for all
                why = (f"`{queries[why] or 'npu-smi info -t spod-info'}`"
                       + (f" (and the same for the other {len(devs) - 1})" if len(devs) > 1 else "") + f" {why}")
            problems.append(f"host {h.name} {device_ids(devs)}: no super_device_id in the inventory, {why}")
        pod = h.super_pod_id
        if pod is None and got is not None:
            pods = {d: i.super_pod_id for d, i in got.items() if i.super_pod_id is not None}
            if len(set(pods.values())) > 1:
                problems.append(f"host {h.name}: npu-smi reports different Super Pod IDs on its devices "
                                f"({', '.join(f'{d}: {p}' for d, p in sorted(pods.items()))})")
            elif pods:
                pod = next(iter(pods.values()))
        if pod is None and not lacking:
            why = ("npu-smi was not asked (run `orch plan --probe`)" if got is None else
                   "npu-smi printed no Super Pod ID")
            problems.append(f"host {h.name}: no super_pod_id in the inventory, {why}")
        hosts.append(replace(h, super_device_ids=ids, super_pod_id=pod))
    if not problems:  # the spares alone: each takes one host's place (launchers.spare_launch)
        problems = super_pod_problems(hosts[:len(plan.hosts)])
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise PlanError(
            "rank table 1.2 (Atlas A3) needs every device's super_device_id and every host's super_pod_id:\n"
            + "\n".join(f"  - {p}" for p in shown),
            hint="give them in the inventory (super_device_ids: {0: <SDID>, ...} and super_pod_id: N on the "
                 "host) or make `npu-smi info -t spod-info -i <NPU ID> -c <Chip ID>` print them on the host "
                 "(its SDID and Super Pod ID lines)")
    return replace(plan, hosts=tuple(hosts[:len(plan.hosts)]), spares=tuple(hosts[len(plan.hosts):]))


def super_pod_problems(hosts: Sequence[Host]) -> list[str]:
    """What HCCL refuses in complete values: an empty or out-of-range super_device_id, one
    super_device_id twice in a SuperPoD, a SuperPoD whose servers are not listed together (in
    plan order)."""
    out: list[str] = []
    seen: dict[tuple[int | None, int], str] = {}
    for h in hosts:
        for d in h.devices:
            v = h.super_device_ids.get(d)
            if v is None or str(v).strip() == "" or not str(v).isdigit() or int(v) > MAX_SUPER_DEVICE_ID:
                out.append(f"host {h.name} device {d}: super_device_id {v!r} is not an unsigned 32-bit integer "
                           "(HCCL's RanktableCheck refuses it)")
                continue
            key = (h.super_pod_id, int(v))
            if key in seen:
                out.append(f"host {h.name} device {d}: super_device_id {v} is also {seen[key]}'s, in super pod "
                           f"{h.super_pod_id} (HCCL: devices have same superDeviceId in superPod)")
            else:
                seen[key] = f"host {h.name} device {d}"
        if h.super_pod_id is None:
            out.append(f"host {h.name}: no super_pod_id")
    order: list[tuple[int | None, list[str]]] = []
    for h in hosts:
        if not order or order[-1][0] != h.super_pod_id:
            order.append((h.super_pod_id, []))
        order[-1][1].append(h.name)
    pods = [p for p, _ in order]
    split = sorted({p for p in pods if pods.count(p) > 1}, key=str)
    for p in split:
        runs = [fold(names) for q, names in order if q == p]
        out.append(f"super pod {p}: its servers are not listed together in plan order ({' | '.join(runs)} are "
                   "separated by other super pods' servers) and HCCL wants one super pod's servers after another's: "
                   "give every host its super_pod_id in the inventory, orch then orders the hosts by super pod")
    return out


def device_ids(devs: Sequence[int]) -> str:
    """'device 3', 'devices 0-15', 'devices 0,2,5-7'."""
    if len(devs) == 1:
        return f"device {devs[0]}"
    runs: list[list[int]] = []
    for d in sorted(devs):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return "devices " + ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _quote(text: str, n: int = 160) -> str:
    t = " ".join(text.strip().split())
    return repr(t if len(t) <= n else t[:n] + "...") if t else "no output"
