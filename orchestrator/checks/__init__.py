"""`orch check`: the preflight that catches what breaks multi-host training.

Each check is one object (base.Check) in a module of its own here: when it applies to a host,
the shell it needs in the host's probe, how it judges one host from that output and, if it
compares hosts, how it judges them together. All of a host's sections go out as ONE probe
script over the host's ONE connection (probes.py: the script's frame and the parsers); checks
that compare hosts (same user, same versions, same NIC name, unique device IPs) give
cluster-wide results (host None) that name every host involved, folded (`lab-h[1-3]`).

    report = run_checks(cluster, pool, rank_plan, full_mesh=False, on_result=print)
    report.ok, report.to_json(), report.cells(), report.problems()

The checks (names.KNOWN_CHECKS, the report's order; `checks.skip` skips them):
ssh, mesh, user, versions, path, nic, devices, device-rules, workdir, disk, files, ports,
stale, clock, and with --deep health (health.py). A host that cannot be reached fails `ssh`
and every other check of it is `error` ("not checked"); the other hosts' results stand.

Adding a check: a module here that registers a Check (base.register), its name in
names.KNOWN_CHECKS (its place in the report), and its section's pinned text under
tests/fixtures/checks/sections/.

This package's own import is light (spec.py reads names.KNOWN_CHECKS): its public names below
load the modules that hold them on first use.
"""

from __future__ import annotations

import importlib

from .names import KNOWN_CHECKS

_PUBLIC = {
    "base": ("SEVERITY", "Check", "CheckResult", "Probe", "ProbeRun", "Problem", "Report", "Status", "register",
             "registered"),
    "checkplan": ("CheckPlan", "active_checks", "make_check_plan", "needed_tools", "sync_manifest", "try_plan",
                  "version_tools"),
    "runner": ("HEAD_START", "applies", "check_script", "judge_across", "judge_cluster_local", "judge_host", "probe_for",
            "probe_host", "probe_script", "resolve_address", "run_checks"),
    "clock": ("clock_skew", "judge_clock", "judge_hccl_timeout"),
    "device_rules": ("judge_device_rules",),
    "devices": ("judge_device_ips", "judge_devices"),
    "disk": ("judge_disk",),
    "files": ("judge_files",),
    "mesh": ("judge_mesh",),
    "nic": ("judge_interface", "judge_interfaces", "judge_nic", "judge_nic_names"),
    "path": ("judge_path", "launch_tools"),
    "ports": ("judge_ports",),
    "stale": ("judge_stale",),
    "user": ("judge_user", "judge_users"),
    "versions": ("host_versions", "judge_versions"),
    "workdir": ("judge_workdir", "workdir_exposure"),
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = ["KNOWN_CHECKS", *sorted(_WHERE)]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
