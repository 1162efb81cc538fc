"""disk: free space on the filesystem that holds (or will hold) job.workdir."""

from __future__ import annotations

import shlex

from .. import probes
from ..probes import Section
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, register, result, section
from .workdir import WORKDIR

DF = Probe("df", lambda plan, host: [("df", (
    f"d={shlex.quote(plan.cluster.job.workdir)}\nwhile [ ! -d \"$d\" ]; do d=${{d%/*}}; [ -n \"$d\" ] || d=/; done\n"
    "$T df -Pk -- \"$d\""))])


def judge_disk(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    if sec.rc != 0 and not sec.body.strip().startswith("Filesystem"):
        return result("disk", host, "error", f"df -Pk failed (exit {sec.rc}): {probes.quote_output(sec.body)}")
    d = probes.parse_df(sec.body)
    free = d.avail_kib / (1 << 20)
    need = cluster.checks.min_free_gib
    if free < need:
        return result("disk", host, "fail", f"only {free:.1f} GiB free on {d.mount} (holds {cluster.job.workdir}); "
                                            f"checks.min_free_gib is {need:g}: free some space")
    return result("disk", host, "pass", f"{free:.1f} GiB free on {d.mount}")


register(Check("disk", probes=(WORKDIR, DF),
               judge=lambda plan, run: [judge_disk(plan.cluster, run.host, section(run.sections, "df"))]))
