"""workdir: job.workdir exists (or can be made) and is writable by the login user, and no other
user could change what the ranks run there. Its section also serves disk and files."""

from __future__ import annotations

import shlex

from .. import probes
from ..probes import Section
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, register, result, section

WORKDIR = Probe("workdir", lambda plan, host: [("workdir", (
    f"W={shlex.quote(plan.cluster.job.workdir)}\n"
    "if [ -d \"$W\" ]; then echo existed=yes; else echo existed=no\n"
    "  if e=$(mkdir -p -- \"$W\" 2>&1); then echo mkdir=ok; else echo \"mkdir=$e\"; fi; fi\n"
    # mktemp: a new file of a random name (O_EXCL), never one another user planted
    "if [ -d \"$W\" ]; then\n"
    "  if f=$(mktemp -- \"$W/.orch-check.XXXXXXXX\" 2>&1); then rm -f -- \"$f\"; echo write=ok; "
    "else echo \"write=$f\"; fi; fi\n"
    # who could change what runs: the owner and mode of the workdir and of every parent
    # (of its real path: a link's own mode says nothing). A real path (readlink -f: absolute, no
    # `//`, `.` or trailing `/`) has its parents by cutting at `/`, and one stat reads them all
    # (the existing ones, in that order); otherwise dirname and stat, a directory at a time
    "echo uid=$(id -u)\n"
    "if d=$(readlink -f -- \"$W\" 2>/dev/null) && [ \"${d#/}\" != \"$d\" ]; then set -- \"$d\"\n"
    "  while [ \"$d\" != / ]; do d=${d%/*}; d=${d:-/}; set -- \"$@\" \"$d\"; done\n"
    "  stat -c 'perm=%a %u %n' -- \"$@\" 2>/dev/null\n"
    "else d=\"$W\"\nwhile :; do\n"
    "  [ -e \"$d\" ] && echo \"perm=$(stat -c '%a %u' -- \"$d\") $d\"\n"
    "  [ \"$d\" = / ] && break; d=$(dirname -- \"$d\"); done; fi"))])


def judge_workdir(cluster: Cluster, host: Host, sec: Section) -> CheckResult:
    w = probes.parse_workdir(sec.body)
    wd = cluster.job.workdir
    if w.mkdir_error:
        return result("workdir", host, "fail", f"{wd} does not exist and cannot be created: "
                                               f"{w.mkdir_error.strip()}; choose another job.workdir or create it "
                                               "with the right owner")
    if not w.writable:
        return result("workdir", host, "fail", f"{wd} is not writable: {(w.write_error or 'unknown').strip()}; "
                                               "fix its owner/permissions or choose another job.workdir")
    unsafe = workdir_exposure(w)
    if unsafe:
        return result("workdir", host, "fail", f"{unsafe}: another user could replace what the ranks run (as "
                                               "OpenSSH's StrictModes refuses for ~/.ssh)")
    return result("workdir", host, "pass", f"{wd} {'exists' if w.existed else 'created'}, writable")


def workdir_exposure(w: probes.Workdir) -> str | None:
    """Why another user could change files in the workdir: it or a parent is writable by group or
    others (a root-owned sticky directory such as /tmp excepted), or owned by someone else."""
    for mode, owner, path in w.perms:
        if w.uid is not None and owner not in (0, w.uid):
            return f"{path} is owned by uid {owner}, not by the job's user (uid {w.uid}) or root; fix: use a " \
                   "workdir under directories you own"
        if mode & 0o022 and not (mode & 0o1000 and owner == 0):
            who = 'group and others' if mode & 0o022 == 0o022 else 'its group' if mode & 0o020 else 'others'
            return f"{path} is writable by {who} (mode {mode & 0o7777:o}); fix: chmod go-w {path}"
    return None


register(Check("workdir", probes=(WORKDIR,),
               judge=lambda plan, run: [judge_workdir(plan.cluster, run.host, section(run.sections, "workdir"))]))
