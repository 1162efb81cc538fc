"""ports: job.master_port is free on the launch host (msrun's scheduler, torchrun's store)."""

from __future__ import annotations

from .. import probes
from ..probes import Section
from ..launchers import launcher
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, register, result, section


def _applies(plan, host: Host) -> bool:
    return launcher(plan.cluster).uses_master_port and host.name == plan.launch.name


PORTS = Probe("ports", lambda plan, host: [("ports", "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null || ss -ltn")]
              if _applies(plan, host) else [])


def judge_ports(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    port = cluster.job.master_port
    listening = probes.parse_listening_ports(sec.body)
    if port in listening:
        return result("ports", host, "fail", f"master_port {port} is already in use on the launch host (something "
                                             "listens on it; a leftover msrun scheduler or torchrun store?): stop it "
                                             "or change job.master_port")
    return result("ports", host, "pass", f"master_port {port} is free")


register(Check("ports", applies=_applies, probes=(PORTS,),
               judge=lambda plan, run: [judge_ports(plan.cluster, run.host, section(run.sections, "ports"))]))
