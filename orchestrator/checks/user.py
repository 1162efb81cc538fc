"""user: who the probe logged in as (`id -un`); across hosts, the same user everywhere (mpirun
logs in to every host as the launch host's user)."""

from __future__ import annotations

from typing import Mapping

from .. import probes
from ..probes import Section
from ..launchers import LAUNCHERS
from ..logins import is_root
from ..model import Host
from .base import Check, CheckResult, Probe, register, result, section, split_by

USER = Probe("user", lambda plan, host: [("user", "id -un")])


def judge_user(host: Host, sec: Section, launcher: str = "mpirun") -> CheckResult:
    user = sec.body.strip()
    if sec.rc != 0 or not user or len(user.split()) != 1:
        return result("user", host, "error", f"`id -un` failed: {probes.quote_output(sec.body)}")
    if is_root(user=user):
        return result("user", host, "warn", "logged in as root"
                      + (f": {launcher} needs --allow-run-as-root (orch adds it)" if LAUNCHERS[launcher].root_flag else "")
                      + "; a non-root user is safer")
    return result("user", host, "pass", f"logged in as {user}")


def judge_users(per_host: Mapping[str, str], launcher: str) -> list[CheckResult]:
    """{host: login user} -> a cluster-wide fail (mpirun) or warn when they differ."""
    groups, parts = split_by(per_host)
    if len(groups) <= 1:
        return []
    if LAUNCHERS[launcher].needs_mesh:
        return [CheckResult("user", None, "fail", f"the login user differs: {parts}; {launcher} logs in to every host "
                            "as the launch host's user: use the same user everywhere (inventory defaults.user)",
                            tuple(per_host))]
    return [CheckResult("user", None, "warn", f"the login user differs: {parts}", tuple(per_host))]


def _across(plan, runs) -> list[CheckResult]:
    users = {}
    for r in runs:
        s = r.sections.get("user")
        if s is not None and s.rc == 0 and s.body.strip() and len(s.body.split()) == 1:
            users[r.host.name] = s.body.strip()
    return judge_users(users, plan.cluster.job.launcher)


register(Check("user", probes=(USER,),
               judge=lambda plan, run: [judge_user(run.host, section(run.sections, "user"), plan.cluster.job.launcher)],
               across=_across))
