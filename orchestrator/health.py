"""`orch check --deep`: device health before a long job (check `health`, Ascend and GPU only).

Pure: the probe sections' shell text, parsers of what they print, and one judge per host. The
sections go into the host's one probe script (only when the plan's checks name `health`, i.e.
with --deep) and the judge is called for each host, both through the check in checks/health.py.
See docs/health.md.

Ascend (job.platform ascend), for each planned device of the host:
  * `npu-smi info` health column (the probe's `npu` section, shared with the devices check):
    OK passes, Warning warns, Alarm and Critical fail.
  * `hccn_tool -i N -link -g`: `link status: UP` passes, DOWN fails.
  * `hccn_tool -i N -net_health -g`: Success passes, Init warns (detection not running yet),
    Socket fail(ed) / Receive timeout / Unreachable / Time exceeded / Fault / Thread error /
    Detect ip set fail.
  * `hccn_tool -i N -ping -g address IP`: device N pings device N of the NEXT host in plan order
    (the last host pings the first) when the inventory gives that host's device_ips; otherwise the
    address its own /etc/hccn.conf gives as netdetect_N (else gateway_N). The peer's device IP
    from ITS hccn.conf is not known when the script is built (one probe per host, all at once).
    All packets lost fails; some lost warns (the first is often lost to ARP). Pings stop after
    PING_BUDGET seconds per host; the devices left are reported as not pinged (warn).
GPU (job.platform gpu), for each planned GPU:
  * `nvidia-smi --query-gpu=...,ecc.errors.uncorrected.volatile.total,retired_pages.pending,
    remapped_rows.pending,remapped_rows.failure --format=csv` (the remapped_rows fields dropped
    for drivers that do not know them): uncorrected volatile ECC errors, pages pending retirement,
    rows pending remap or a remap failure fail; ECC disabled warns; [N/A] (no ECC) passes.
  * NVIDIA XID events in the kernel log (`dmesg`, else `journalctl -k`), those of the last
    XID_WINDOW seconds: hardware XIDs (SEVERE_XIDS) fail, others warn. An unreadable kernel log
    is said in the pass message.
A missing tool is a warn ("... not found: ... not checked"), output that cannot be read an error
quoting it; one result per host, the worst of its findings.
"""

from __future__ import annotations

import csv
import io
import re
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from .devices import HCCN_CONF
from .probes import NOT_INSTALLED, ProbeError, Section, parse_npu_smi, quote_output
from .model import Cluster, Host
from .rankplan import order_hosts

HCCN_TOOL = "/usr/local/Ascend/driver/tools/hccn_tool"  # where the driver installs it (often not on PATH)
PING_TIMEOUT = 10  # seconds, one hccn_tool ping (3 packets)
PING_BUDGET = 60  # seconds of a host's probe spent pinging at most
XID_WINDOW = 24 * 3600  # seconds: older XIDs in the kernel log are not judged
XID_LINES = 50  # the last this many XID lines are sent back
# Hardware XIDs (Azure HPC's node health check list, plus the ECC, GSP and NVLink ones of NVIDIA's
# XID catalog): the GPU needs a reset, a reboot or a look. Other XIDs are mostly the application's.
SEVERE_XIDS = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119,
                         120, 140, 144, 145, 146, 147, 148, 149, 150})
GPU_FIELDS = ("index", "name", "pci.bus_id", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
              "retired_pages.pending")
GPU_FIELDS_REMAP = GPU_FIELDS + ("remapped_rows.pending", "remapped_rows.failure")  # drivers >= R450
NET_HEALTH_OK = "Success"
NET_HEALTH_WARN = ("Init",)  # the detection task is starting (or has no address to detect yet)
NET_HEALTH_FAIL = ("Socket fail", "Socket failed", "Receive timeout", "Unreachable", "Time exceeded", "Fault",
                   "Thread error", "Detect ip set")
NPU_FAIL = ("Alarm", "Critical")

MARK_RUN = "orch:run"
MARK_RC = "orch:rc"
MARK_PING = "orch:ping"


# --------------------------------------------------------------------------- the probe sections


def ping_targets(cluster: Cluster, host: Host) -> tuple[Host | None, dict[int, str]]:
    """(the next host in plan order, {planned device: its same-index device IP from the inventory})."""

    hosts = order_hosts(cluster.hosts)
    names = [h.name for h in hosts]
    if len(hosts) < 2 or host.name not in names:
        return None, {}
    peer = hosts[(names.index(host.name) + 1) % len(hosts)]
    return peer, {d: peer.device_ips[d] for d in host.devices if peer.device_ips.get(d)}


def hccn_script(devices: Sequence[int], peer_ips: Mapping[int, str]) -> str:
    """Link, net health and one ping for each device, in turn (hccn_tool answers "busy" to
    concurrent calls). Lines `orch:run DEV WHAT` / `orch:ping DEV ADDR SOURCE` open each command's
    output, `orch:rc N` closes it."""
    q = shlex.quote
    lines = [f"H=$(command -v hccn_tool 2>/dev/null) || H={HCCN_TOOL}",
             f"[ -x \"$H\" ] || {{ echo {NOT_INSTALLED}; exit 0; }}",
             f"P=; command -v timeout >/dev/null 2>&1 && P='timeout {PING_TIMEOUT}'",
             "t0=$(date +%s)"]
    for d in devices:
        d = int(d)
        for what in ("link", "net_health"):
            lines.append(f"echo '{MARK_RUN} {d} {what}'; $T \"$H\" -i {d} -{what} -g 2>&1; "
                         f"printf '\\n{MARK_RC} %s\\n' \"$?\"")
        if d in peer_ips:
            lines.append(f"a={q(peer_ips[d])}; s=peer")
        else:
            lines.append(f"s=netdetect; a=$(sed -n 's/^[[:space:]]*netdetect_{d}[[:space:]]*=[[:space:]]*"
                         f"\\([^[:space:]#]*\\).*/\\1/p' {HCCN_CONF} 2>/dev/null | tail -n 1)")
            lines.append(f"[ -n \"$a\" ] || {{ s=gateway; a=$(sed -n 's/^[[:space:]]*gateway_{d}[[:space:]]*="
                         f"[[:space:]]*\\([^[:space:]#]*\\).*/\\1/p' {HCCN_CONF} 2>/dev/null | tail -n 1); }}")
        lines.append(f"if [ -z \"$a\" ]; then echo '{MARK_PING} {d} - none'\n"
                     f"elif [ $(($(date +%s) - t0)) -ge {PING_BUDGET} ]; then echo \"{MARK_PING} {d} $a $s\"; "
                     f"echo orch:skipped\n"
                     f"else echo \"{MARK_PING} {d} $a $s\"; $P \"$H\" -i {d} -ping -g address \"$a\" 2>&1; "
                     f"printf '\\n{MARK_RC} %s\\n' \"$?\"; fi")
    return "\n".join(lines)


def gpu_script() -> str:
    """`nvidia-smi --query-gpu` as CSV with its header; without the remapped_rows fields when the
    driver does not know them."""
    new, old = ",".join(GPU_FIELDS_REMAP), ",".join(GPU_FIELDS)
    return (f"command -v nvidia-smi >/dev/null 2>&1 || {{ echo {NOT_INSTALLED}; exit 0; }}\n"
            f"o=$($T nvidia-smi --query-gpu={new} --format=csv 2>&1); r=$?\n"
            f"case $o in *'is not a valid field'*)\n"
            f"  o=$($T nvidia-smi --query-gpu={old} --format=csv 2>&1); r=$? ;; esac\n"
            "printf '%s\\n' \"$o\"; exit $r")


def xid_script() -> str:
    """The host's uptime, then the last XID_LINES `NVRM: Xid` lines of the kernel log and how many
    lines it had (0: not readable by this user), from dmesg or else journalctl -k (this boot)."""
    return ("echo \"uptime $(cut -d' ' -f1 /proc/uptime 2>/dev/null)\"\n"
            f"x() {{ awk '/NVRM: Xid/ {{print}} END {{print \"orch:lines \" NR}}' | tail -n {XID_LINES + 1}; }}\n"
            "o=$($T dmesg 2>/dev/null | x); s=dmesg\n"
            "case $o in *'orch:lines 0') o=$($T journalctl -k -b -q --no-pager -o short-monotonic 2>/dev/null | x); "
            "s=journalctl ;; esac\n"
            "echo \"source $s\"; printf '%s\\n' \"$o\"")


def sections(cluster: Cluster, host: Host) -> list[tuple[str, str]]:
    """(name, body) of the health sections for this host (the Ascend `npu` section comes from
    the devices check, checks/devices.py)."""
    platform = cluster.job.platform
    if platform == "ascend":
        return [("health:hccn", hccn_script(host.devices, ping_targets(cluster, host)[1]))]
    if platform == "gpu":
        return [("health:gpu", gpu_script()), ("health:xid", xid_script())]
    return []


# --------------------------------------------------------------------------- parsers (pure)


def _installed(text: str) -> bool:
    return not text.strip().endswith(NOT_INSTALLED)


def parse_link(text: str) -> str:
    """`hccn_tool -i N -link -g` -> 'UP' or 'DOWN'."""
    m = re.search(r"link status:\s*([A-Za-z]+)", text)
    if not m:
        raise ProbeError(f"unexpected output from `hccn_tool -link -g`: {quote_output(text)}")
    return m.group(1).upper()


def parse_net_health(text: str) -> str:
    """`hccn_tool -i N -net_health -g` -> 'Success', 'Init', 'Receive timeout'..."""
    m = re.search(r"net health status:\s*([^\r\n]*\S)", text)
    if not m:
        raise ProbeError(f"unexpected output from `hccn_tool -net_health -g`: {quote_output(text)}")
    return m.group(1).strip()


@dataclass(frozen=True)
class PingResult:
    sent: int
    received: int
    loss: float  # percent

    @property
    def ok(self) -> bool:
        return self.sent > 0 and self.received == self.sent


def parse_ping(text: str) -> PingResult:
    """`hccn_tool -i N -ping -g address IP` -> packets sent, received, loss % (the summary line;
    without one, the `recv seq=` and `recv time out seq=` lines counted)."""
    m = re.search(r"(\d+) packets transmitted, (\d+) received, ([\d.]+)% packet loss", text)
    if m:
        return PingResult(int(m.group(1)), int(m.group(2)), float(m.group(3)))
    got = len(re.findall(r"^recv seq", text, re.M))
    lost = len(re.findall(r"^(?:recv time out|pkt send fail) seq", text, re.M))
    if got + lost:
        return PingResult(got + lost, got, round(100.0 * lost / (got + lost), 2))
    raise ProbeError(f"unexpected output from `hccn_tool -ping -g`: {quote_output(text)}")


@dataclass(frozen=True)
class Ping:
    address: str
    source: str  # peer (the next host's same-index device), netdetect or gateway (hccn.conf)
    result: PingResult | None  # None: skipped (time budget) or not understood (see error)
    skipped: bool = False
    error: str | None = None


@dataclass(frozen=True)
class DeviceNet:
    """One Ascend device's NIC as hccn_tool sees it; None fields were not understood (see errors)."""
    device: int
    link: str | None = None
    net_health: str | None = None
    ping: Ping | None = None  # None: no address to ping
    errors: tuple[str, ...] = ()


def _blocks(text: str):
    """(header line, output, rc) for each `orch:run`/`orch:ping` block of the hccn section."""
    header: str | None = None
    body: list[str] = []
    out: list[tuple[str, str, int | None]] = []
    for line in text.splitlines():
        if line.startswith((MARK_RUN + " ", MARK_PING + " ")):
            if header is not None:
                out.append((header, "\n".join(body), None))
            header, body = line, []
        elif line.startswith(MARK_RC + " ") and header is not None:
            rc = line.split()[1]
            out.append((header, "\n".join(body), int(rc) if rc.lstrip("-").isdigit() else None))
            header, body = None, []
        elif header is not None:
            body.append(line)
    if header is not None:
        out.append((header, "\n".join(body), None))
    return out


def parse_hccn_section(text: str) -> dict[int, DeviceNet] | None:
    """The `health:hccn` section -> {device: DeviceNet}; None when hccn_tool is not installed."""
    if not _installed(text):
        return None
    found: dict[int, dict] = {}
    for header, body, rc in _blocks(text):
        parts = header.split()
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        d = int(parts[1])
        cur = found.setdefault(d, {"device": d, "errors": []})
        why = f" (exit {rc})" if rc not in (0, None) else ""
        if parts[0] == MARK_RUN:
            try:
                if parts[2] == "link":
                    cur["link"] = parse_link(body)
                elif parts[2] == "net_health":
                    cur["net_health"] = parse_net_health(body)
            except ProbeError as exc:
                cur["errors"].append(f"device {d}: {exc}{why}")
        elif len(parts) >= 4 and parts[2] != "-":
            if body.strip() == "orch:skipped":
                cur["ping"] = Ping(parts[2], parts[3], None, skipped=True)
                continue
            try:
                cur["ping"] = Ping(parts[2], parts[3], parse_ping(body))
            except ProbeError as exc:
                cur["ping"] = Ping(parts[2], parts[3], None, error=f"{exc}{why}")
    if not found:
        raise ProbeError(f"hccn_tool probe printed nothing usable: {quote_output(text)}")
    return {d: DeviceNet(v["device"], v.get("link"), v.get("net_health"), v.get("ping"), tuple(v["errors"]))
            for d, v in sorted(found.items())}


@dataclass(frozen=True)
class GpuHealth:
    index: int
    name: str
    bus_id: str
    ecc_mode: str | None  # Enabled / Disabled / None (no ECC: [N/A])
    uncorrected: int | None  # volatile uncorrected ECC errors since the driver loaded
    retired_pending: bool | None
    remap_pending: bool | None
    remap_failure: bool | None


_NA = re.compile(r"^\[?(N/A|Not Supported|Unknown Error|Requested functionality has been deprecated)\]?$", re.I)


def _value(row: Mapping[str, str], key: str) -> str | None:
    v = row.get(key)
    if v is None:
        return None
    v = v.strip()
    return None if not v or _NA.match(v) else v


def _yes(row: Mapping[str, str], key: str) -> bool | None:
    v = _value(row, key)
    return None if v is None else v.lower() in ("yes", "1", "true")


def parse_gpu_query(text: str) -> dict[int, GpuHealth] | None:
    """`nvidia-smi --query-gpu=index,...,--format=csv` (with its header, fields in any order) ->
    {index: GpuHealth}; None when nvidia-smi is not installed."""
    if not _installed(text):
        return None
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "index" in (c.strip() for c in ln.split(","))), None)
    if start is None:
        raise ProbeError(f"unexpected output from `nvidia-smi --query-gpu`: {quote_output(text)}")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:])), skipinitialspace=True))
    header = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0]]
    gpus: dict[int, GpuHealth] = {}
    for r in rows[1:]:
        if len(r) != len(header):
            continue
        row = dict(zip(header, (c.strip() for c in r)))
        if not row.get("index", "").isdigit():
            continue
        unc = _value(row, "ecc.errors.uncorrected.volatile.total")
        gpus[int(row["index"])] = GpuHealth(
            int(row["index"]), row.get("name", ""), row.get("pci.bus_id", ""), _value(row, "ecc.mode.current"),
            int(unc) if unc is not None and unc.isdigit() else None, _yes(row, "retired_pages.pending"),
            _yes(row, "remapped_rows.pending"), _yes(row, "remapped_rows.failure"))
    if not gpus:
        raise ProbeError(f"nvidia-smi --query-gpu listed no GPU: {quote_output(text)}")
    return gpus


@dataclass(frozen=True)
class Xid:
    xid: int
    pci: str  # as the driver printed it: 0000:3b:00
    at: float | None  # seconds since boot ([monotonic] timestamp), None when the line has none
    line: str  # from `NVRM: Xid` on


@dataclass(frozen=True)
class XidLog:
    readable: bool
    source: str | None
    uptime: float | None
    events: tuple[Xid, ...]


_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\): (\d+),")
_MONO = re.compile(r"^\s*\[\s*(\d+\.\d+)\]")


def parse_xid_log(text: str) -> XidLog:
    """Kernel log lines (dmesg, journalctl -k, in any time format) -> the NVRM XID events; with the
    xid section's `uptime`/`source`/`orch:lines` lines, whether the log could be read at all."""
    up = re.search(r"^uptime (\d+(?:\.\d+)?)\s*$", text, re.M)
    src = re.search(r"^source (\S+)\s*$", text, re.M)
    lines = re.search(r"^orch:lines (\d+)\s*$", text, re.M)
    events = []
    for line in text.splitlines():
        m = _XID.search(line)
        if m:
            t = _MONO.match(line)
            events.append(Xid(int(m.group(2)), m.group(1).lower(), float(t.group(1)) if t else None,
                              line[m.start():].strip()))
    return XidLog(not (lines and lines.group(1) == "0"), src.group(1) if src else None,
                  float(up.group(1)) if up else None, tuple(events))


def bus_key(bus: str) -> tuple[int, int, int] | None:
    """'00000000:3B:00.0' (nvidia-smi) and '0000:3b:00' (XID lines) -> (domain, bus, device)."""
    m = re.search(r"([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})", bus)
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)) if m else None


# --------------------------------------------------------------------------- the judge (pure)


def ids(devices) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ds = sorted(set(int(d) for d in devices))
    runs: list[list[int]] = []
    for d in ds:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _n(word: str, devices) -> str:
    devices = list(devices)
    return f"{word}{'s' if len(devices) > 1 else ''} {ids(devices)}"


@dataclass(frozen=True)
class Verdict:
    status: str  # pass / warn / fail / error
    message: str


_RANK = {"pass": 0, "warn": 1, "error": 2, "fail": 3}


def _verdict(findings: list[tuple[str, str]], checked: list[str]) -> Verdict:
    bad = [(s, m) for s, m in findings if s != "pass"]
    if not bad:
        notes = [m for s, m in findings if s == "pass"]
        return Verdict("pass", "; ".join(checked + notes))
    worst = max(bad, key=lambda f: _RANK[f[0]])[0]
    order = sorted(bad, key=lambda f: -_RANK[f[0]])
    return Verdict(worst, "; ".join(m for _, m in order))


def _section(sections: Mapping[str, Section], name: str) -> Section | None:
    s = sections.get(name)
    return s if s is not None and s.finished else None


def judge_ascend(cluster: Cluster, host: Host, sections: Mapping[str, Section]) -> Verdict:
    devices = list(host.devices)
    findings: list[tuple[str, str]] = []
    checked: list[str] = []
    npu = _section(sections, "npu")
    if npu is None:
        findings.append(("error", "the probe printed no finished `npu-smi info` section"))
    else:
        try:
            npus = parse_npu_smi(npu.body)
        except ProbeError as exc:
            npus = None
            findings.append(("error", f"npu-smi info: {exc}"))
        else:
            if npus is None:
                findings.append(("warn", "npu-smi not found: NPU health not checked"))
        if npus:
            by: dict[str, list[int]] = {}
            for d in devices:
                by.setdefault(npus.get(d, "missing"), []).append(d)
            for health, ds in by.items():
                what = f"NPU {ids(ds)}"
                if health == "missing":
                    findings.append(("fail", f"{what} not listed by npu-smi info"))
                elif health.upper() == "OK":
                    checked.append(f"{what} health OK")
                elif health in NPU_FAIL:
                    findings.append(("fail", f"{what} health {health}"))
                else:
                    findings.append(("warn", f"{what} health {health}"))
    sec = _section(sections, "health:hccn")
    if sec is None:
        findings.append(("error", "the probe printed no finished hccn_tool section (cut off? raise "
                                  "ssh.command_timeout)"))
        return _verdict(findings, checked)
    try:
        nets = parse_hccn_section(sec.body)
    except ProbeError as exc:
        findings.append(("error", str(exc)))
        return _verdict(findings, checked)
    if nets is None:
        findings.append(("warn", "hccn_tool not found: device links, network health and pings not checked"))
        return _verdict(findings, checked)
    peer, _ = ping_targets(cluster, host)
    up, healthy, pinged, unpinged = [], [], [], []
    for d in devices:
        n = nets.get(d)
        if n is None:
            findings.append(("error", f"device {d}: no hccn_tool output (the probe was cut off?)"))
            continue
        findings += [("error", e) for e in n.errors]
        if n.link == "UP":
            up.append(d)
        elif n.link is not None:
            findings.append(("fail", f"device {d}: link {n.link}"))
        if n.net_health == NET_HEALTH_OK:
            healthy.append(d)
        elif n.net_health is not None:
            bad = n.net_health in NET_HEALTH_FAIL or n.net_health.lower().startswith("socket fail")
            st = "fail" if bad else "warn"
            findings.append((st, f"device {d}: net health {n.net_health}"))
        p = n.ping
        if p is None:
            unpinged.append(d)
            continue
        to = f"device {d} -> {p.address} ({f'device {d} of {peer.name}' if p.source == 'peer' and peer else p.source})"
        if p.skipped:
            findings.append(("warn", f"{to}: not pinged (the probe's {PING_BUDGET}s ping budget was spent)"))
        elif p.error:
            findings.append(("error", f"{to}: {p.error}"))
        elif p.result and p.result.received == 0:
            findings.append(("fail", f"{to}: unreachable ({p.result.sent} packets, all lost)"))
        elif p.result and not p.result.ok:
            findings.append(("warn", f"{to}: {p.result.loss:g}% packet loss"))
        else:
            pinged.append((d, p))
    if up:
        checked.append(f"links UP on {_n('device', up)}")
    if healthy:
        checked.append(f"net health Success on {_n('device', healthy)}")
    if pinged:
        srcs = sorted({p.source for _, p in pinged})
        where = ", ".join(f"{peer.name}'s devices" if s == "peer" and peer else f"their {s} address" for s in srcs)
        checked.append(f"{_n('device', (d for d, _ in pinged))} reach {where} (0% loss)")
    if unpinged:
        findings.append(("pass", f"{_n('device', unpinged)} not pinged: no address (set the next host's "
                                 f"device_ips in the inventory, or netdetect_<id> in {HCCN_CONF})"))
    return _verdict(findings, checked)


def judge_gpu(cluster: Cluster, host: Host, sections: Mapping[str, Section]) -> Verdict:
    devices = list(host.devices)
    findings: list[tuple[str, str]] = []
    checked: list[str] = []
    sec = _section(sections, "health:gpu")
    gpus: dict[int, GpuHealth] | None = None
    if sec is None:
        findings.append(("error", "the probe printed no finished nvidia-smi health section"))
    else:
        try:
            gpus = parse_gpu_query(sec.body)
        except ProbeError as exc:
            findings.append(("error", f"{exc}" + (f" (exit {sec.rc})" if sec.rc else "")))
        else:
            if gpus is None:
                findings.append(("warn", "nvidia-smi not found: GPU health (ECC, XID) not checked"))
    if gpus:
        clean = []
        for d in devices:
            g = gpus.get(d)
            if g is None:
                findings.append(("fail", f"GPU {d} not listed by nvidia-smi"))
                continue
            why = []
            if g.uncorrected:
                why.append(f"{g.uncorrected} uncorrectable ECC error(s) since the driver loaded")
            if g.retired_pending:
                why.append("pages pending retirement (reboot or reset the GPU)")
            if g.remap_pending:
                why.append("rows pending remap (reset the GPU)")
            if g.remap_failure:
                why.append("row remapping failed (the GPU needs replacing)")
            if why:
                findings.append(("fail", f"GPU {d} ({g.name}): {', '.join(why)}"))
            elif (g.ecc_mode or "").lower() == "disabled":
                findings.append(("warn", f"GPU {d} ({g.name}): ECC disabled, memory errors go undetected"))
            else:
                clean.append(d)
        if clean:
            ecc = [d for d in clean if gpus[d].ecc_mode]
            checked.append(f"{_n('GPU', clean)}: " + ("no uncorrectable ECC errors, no pending retirement/"
                                                                 "remap" if ecc else "no ECC on these GPUs"))
    xsec = _section(sections, "health:xid")
    if xsec is None:
        findings.append(("error", "the probe printed no finished kernel-log (XID) section"))
        return _verdict(findings, checked)
    log = parse_xid_log(xsec.body)
    if not log.readable:
        findings.append(("pass", "kernel log not readable by this user: XIDs not checked"))
        return _verdict(findings, checked)
    index = {bus_key(g.bus_id): i for i, g in (gpus or {}).items()}
    recent: dict[tuple[int, str], list[Xid]] = {}
    old = 0
    for e in log.events:
        i = index.get(bus_key(e.pci))
        if i is not None and i not in devices:
            continue  # a GPU this job does not use
        if e.at is not None and log.uptime is not None and log.uptime - e.at > XID_WINDOW:
            old += 1
            continue
        recent.setdefault((e.xid, f"GPU {i}" if i is not None else f"PCI {e.pci}"), []).append(e)
    for (xid, where), evs in sorted(recent.items()):
        ago = ""
        if evs[-1].at is not None and log.uptime is not None:
            ago = f", last {max(0.0, log.uptime - evs[-1].at) / 3600:.1f}h ago"
        msg = f"XID {xid} on {where} ({len(evs)}x{ago}): {quote_output(evs[-1].line)}"
        findings.append(("fail" if xid in SEVERE_XIDS else "warn", msg))
    if not recent:
        checked.append(f"no XID in the kernel log ({log.source or 'dmesg'}) for {XID_WINDOW // 3600}h"
                       + (f", {old} older" if old else ""))
    return _verdict(findings, checked)


def judge(cluster: Cluster, host: Host, sections: Mapping[str, Section]) -> Verdict:
    """The host's health verdict (its worst finding)."""
    if cluster.job.platform == "ascend":
        return judge_ascend(cluster, host, sections)
    return judge_gpu(cluster, host, sections)
