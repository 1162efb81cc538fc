"""nic: the inventory address is one of the host's own (the launcher hands it out for ranks to
reach the host), job.interface exists there with an IPv4 address; across hosts, the same
interface names (else a subnet to pick by) and job.interface in one subnet."""

from __future__ import annotations

import ipaddress
from typing import Iterable, Mapping

from .. import probes
from ..probes import IfAddr, ProbeError, Section
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, register, result, section, split_by


def _shell(plan, host: Host) -> list[tuple[str, str]]:
    out = [("nic", "ip -o addr show 2>/dev/null || hostname -I")]
    if plan.cluster.job.interface:
        out.append(("iface", probes.interface_script(plan.cluster.job.interface, plan.launch.cluster_address)))
    return out


NIC = Probe("nic", _shell)


def judge_nic(host: Host, sec: Section, resolved: Iterable[str] | None) -> tuple[CheckResult, IfAddr | None]:
    """Is the inventory address one of the host's own? -> (result, the interface address carrying it)."""
    if host.connection == "local" and host.cluster_address in ("127.0.0.1", "localhost", "::1"):
        return result("nic", host, "pass", "this machine (connection: local)"), None
    addrs = probes.parse_ip_addrs(sec.body)
    wanted = set(resolved or ())
    if not wanted:
        try:
            wanted = {str(ipaddress.ip_address(host.cluster_address))}
        except ValueError:
            return result("nic", host, "warn", f"cannot resolve {host.cluster_address} on this machine, so cannot "
                                               "tell which interface carries it"), None
    for a in addrs:
        if a.address in wanted:
            where = f"on {a.ifname}" if a.ifname else "assigned (interface name unknown: no `ip` command)"
            return result("nic", host, "pass", f"{a.address} {where}"), a
    have = ", ".join(f"{a.ifname + ' ' if a.ifname else ''}{a.address}" for a in addrs
                     if not a.address.startswith(("127.", "::1", "fe80:"))) or "none"
    return result("nic", host, "fail", f"{host.cluster_address} is not an address of this host (it has: {have}); "
                                       "the launcher will hand out this address for ranks to reach the host: use "
                                       "the address the hosts reach each other on in the inventory"), None


def judge_interface(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    """job.interface on this host: it must exist and have an IPv4 address."""
    want = cluster.job.interface
    assert want is not None  # _judge asks only when job.interface is set
    got = probes.parse_interface(sec.body)
    problem = probes.interface_problem(want, got)
    if problem is not None:
        return result("nic", host, "fail", problem)
    assert got is not None  # interface_problem says what is wrong when nothing was found
    return result("nic", host, "pass", f"job.interface {want}: {got.ifname} {got.address}/{got.prefixlen}")


def judge_interfaces(per_host: Mapping[str, IfAddr]) -> list[CheckResult]:
    """The interfaces job.interface picked on each host -> warn when they sit in different subnets
    (ranks on one would not reach ranks on another through it)."""
    nets = {h: net for h, a in per_host.items() if (net := probes.interface_network(a)) is not None}
    groups, parts = split_by(nets)
    if len(groups) <= 1:
        return []
    return [CheckResult("nic", None, "warn", f"job.interface sits in different subnets: {parts}; unless they are "
                        "routed to each other, ranks will not reach each other through it",
                        tuple(h for hs in groups.values() for h in hs))]


def judge_nic_names(per_host: Mapping[str, IfAddr]) -> list[CheckResult]:
    """{host: interface address carrying its inventory address} -> warn when the names differ."""
    named = {h: a for h, a in per_host.items() if a.ifname}
    groups, parts = split_by({h: a.ifname for h, a in named.items() if a.ifname})
    if len(groups) <= 1:
        return []
    nets = []
    for a in named.values():
        if a.prefixlen is not None:
            net = str(ipaddress.ip_network(f"{a.address}/{a.prefixlen}", strict=False))
            if net not in nets:
                nets.append(net)
    sel = ",".join(nets) if nets else "<subnet>"
    return [CheckResult("nic", None, "warn", f"the hosts' addresses are on differently named interfaces: {parts}; "
                        f"pick the network by subnet instead of name: job.mpirun_args "
                        f"[-mca, btl_tcp_if_include, {sel}, -mca, oob_tcp_if_include, {sel}] "
                        "(NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME per host env for gpu/ascend)",
                        tuple(named))]


def _judge(plan, run) -> list[CheckResult]:
    s = run.sections
    out = [judge_nic(run.host, section(s, "nic"), run.addresses)[0]]
    if plan.cluster.job.interface:
        out.append(judge_interface(plan.cluster, run.host, section(s, "iface")))
    return out


def _across(plan, runs) -> list[CheckResult]:
    if plan.cluster.job.interface:
        chosen = {}
        for r in runs:
            s = r.sections.get("iface")
            got = probes.parse_interface(s.body) if s is not None and s.finished else None
            if got is not None:
                chosen[r.host.name] = got
        return judge_interfaces(chosen)
    carriers = {}
    for r in runs:
        s = r.sections.get("nic")
        if s is None or not s.finished:
            continue
        try:
            _, a = judge_nic(r.host, s, r.addresses)
        except ProbeError:
            continue
        if a is not None:
            carriers[r.host.name] = a
    return judge_nic_names(carriers)


register(Check("nic", probes=(NIC,), judge=_judge, across=_across))
