"""devices: the planned GPUs/NPUs exist (nvidia-smi -L, npu-smi info) and, on Ascend, every
planned device has an IP (inventory device_ips, else /etc/hccn.conf); across hosts, device IPs
unique and each device index on one subnet."""

from __future__ import annotations

import ipaddress
from typing import Mapping

from .. import probes
from ..devices import HCCN_CONF, HccnDevice
from ..rankplan import order_hosts
from ..probes import NOT_INSTALLED, ProbeError, Section
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, ids, register, result, section, split_by

ASCEND = Probe("ascend-devices", lambda plan, host: [
    ("hccn", f"if [ -f {HCCN_CONF} ]; then cat {HCCN_CONF}; else echo {NOT_INSTALLED}; fi"),
    ("npu", f"if command -v npu-smi >/dev/null 2>&1; then $T npu-smi info; else echo {NOT_INSTALLED}; fi"),
] if plan.cluster.job.platform == "ascend" else [])
GPUS = Probe("gpus", lambda plan, host: [
    ("gpus", f"if command -v nvidia-smi >/dev/null 2>&1; then $T nvidia-smi -L; else echo {NOT_INSTALLED}; fi"),
] if plan.cluster.job.platform == "gpu" else [])


def judge_devices(cluster: Cluster, host: Host, sections: Mapping[str, Section]) -> CheckResult:
    if cluster.job.platform == "gpu":
        sec = section(sections, "gpus")
        if sec.rc not in (0, None) and "GPU " not in sec.body:
            return result("devices", host, "fail", f"nvidia-smi -L failed (exit {sec.rc}): "
                                                   f"{probes.quote_output(sec.body)}")
        gpus = probes.parse_nvidia_smi_l(sec.body)
        if gpus is None:
            return result("devices", host, "fail", "nvidia-smi not found: cannot see the GPUs "
                                                   "(is the NVIDIA driver installed and on PATH?)")
        lacking = [d for d in host.devices if d not in gpus]
        if lacking:
            return result("devices", host, "fail", f"planned GPUs {lacking} do not exist: nvidia-smi -L lists "
                                                   f"{ids(gpus)}; fix devices/slots in the inventory")
        names = sorted({gpus[d] for d in host.devices})
        return result("devices", host, "pass", f"GPUs {ids(host.devices)} present ({', '.join(names)})")
    # ascend
    hccn = probes.parse_hccn(section(sections, "hccn").body)
    npu_sec = sections.get("npu")
    npus = None
    npu_note = ""
    if npu_sec is not None and npu_sec.finished:
        try:
            npus = probes.parse_npu_smi(npu_sec.body)
        except ProbeError as exc:
            npu_note = f"; npu-smi info not understood ({exc})"
    problems, warnings = [], []
    if npus is not None:
        lacking = [d for d in host.devices if d not in npus]
        if lacking:
            problems.append(f"planned NPUs {lacking} do not exist: npu-smi info lists {ids(npus)}")
        sick = [f"{d} ({npus[d]})" for d in host.devices if d in npus and npus[d].upper() != "OK"]
        if sick:
            warnings.append(f"NPU health not OK: {', '.join(sick)}")
    no_ip = [d for d in host.devices if d not in host.device_ips and (hccn is None or hccn.get(d) is None
                                                                       or hccn[d].address is None)]
    if no_ip:
        where = f"{HCCN_CONF} does not exist" if hccn is None else f"{HCCN_CONF} has no address_<id> for them"
        problems.append(f"no device IP for planned devices {no_ip}: {where} and the inventory gives no "
                        "device_ips (set them with hccn_tool -i <id> -ip -s address <ip> netmask <mask>)")
    bad = []
    for d in host.devices:
        ip = host.device_ips.get(d) or (dev.address if hccn and (dev := hccn.get(d)) else None)
        if ip is not None:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                bad.append(f"{d}={ip}")
    if bad:
        problems.append(f"device IPs that are not IP addresses: {', '.join(bad)}")
    if problems:
        return result("devices", host, "fail", "; ".join(problems + warnings) + npu_note)
    if warnings:
        return result("devices", host, "warn", "; ".join(warnings) + npu_note)
    seen = "" if npus is not None else " (npu-smi not found: presence not checked)"
    return result("devices", host, "pass", f"device IPs for devices {ids(host.devices)}{seen}{npu_note}")


def judge_device_ips(cluster: Cluster, hccn: Mapping[str, Mapping[int, HccnDevice] | None]
                     ) -> list[CheckResult]:
    """Device IPs unique across the cluster; each device index on one subnet across hosts (pure)."""
    by_ip: dict[str, list[str]] = {}
    nets: dict[int, dict[str, str]] = {}
    hosts = [h for h in order_hosts(cluster.hosts) if h.name in hccn]
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
                nets.setdefault(d, {})[h.name] = net
    out = []
    dups = {ip: where for ip, where in by_ip.items() if len(where) > 1}
    if dups:
        parts = "; ".join(f"{ip} on {', '.join(w)}" for ip, w in list(dups.items())[:10])
        out.append(CheckResult("devices", None, "fail", f"device IPs used twice: {parts}; every device NIC needs "
                               "its own address (fix /etc/hccn.conf or device_ips)", tuple(h.name for h in hosts)))
    for d, per_host in sorted(nets.items()):
        groups, parts = split_by(per_host)
        if len(groups) > 1:
            out.append(CheckResult("devices", None, "fail", f"device {d} is on different subnets: {parts}; device "
                                   f"{d} of every host must share one subnet (HCCL connects same-index devices)",
                                   tuple(h for hs in groups.values() for h in hs)))
    return out


def hccn_confs(runs) -> dict[str, dict[int, HccnDevice] | None]:
    """{host: its /etc/hccn.conf (None: there is none)} from the probes that read it."""
    out = {}
    for r in runs:
        s = r.sections.get("hccn") if r.sections is not None else None
        if s is not None and s.finished:
            out[r.host.name] = probes.parse_hccn(s.body)
    return out


def _across(plan, runs) -> list[CheckResult]:
    if plan.cluster.job.platform != "ascend":
        return []
    return judge_device_ips(plan.cluster, hccn_confs(runs))


register(Check("devices", applies=lambda plan, host: plan.cluster.job.platform in ("ascend", "gpu"),
               probes=(ASCEND, GPUS), judge=lambda plan, run: [judge_devices(plan.cluster, run.host, run.sections or {})],
               across=_across))
