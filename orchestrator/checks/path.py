"""path: every executable the launch needs (mpirun, orted, msrun, torchrun, the command's own)
is found where the launcher will look for it (the ranks' PATH with job.env, the plain
non-interactive ssh PATH mpirun's orted gets, or an absolute path); and python3 >= 3.8 for the
run's supervisor on the plain PATH."""

from __future__ import annotations

import shlex

from .. import probes, sh
from ..probes import Section
from ..launchers import launcher
from ..launchers.mpirun import mpirun_prefix
from ..model import Cluster, Host
from . import reach
from .base import Check, CheckResult, Probe, register, result, section
from ..prepare import probe_facts
from ..supervisor import python_problem, python_sh

PLAYBOOK_VENVS = "/opt/orch-venvs/"   # where scripts/install-e2e-deps.sh puts the playbooks' venv


def launch_tools(cluster: Cluster) -> list[tuple[str, str]]:
    """(label, how to find it) for each executable the launch needs on every host.

    how: "job" (PATH of the ranks: job.env applied), "plain" (the non-interactive ssh PATH,
    what mpirun's own ssh gets) or an absolute path."""
    job = cluster.job
    out = launcher(cluster).programs(cluster)
    exe = job.command[0] if job.command else None
    if exe and not any(label == exe for label, _ in out):
        if "/" not in exe:
            out.append((exe, "job"))
        elif exe.startswith("/"):
            out.append((exe, exe))
        # a relative path is resolved in workdir: usually one of the synced files
    return out


def _shell(plan, host: Host) -> list[tuple[str, str]]:

    env = probes.tool_env(plan.cluster, host)
    plain: list[tuple[str, str]] = []
    job: list[tuple[str, str]] = []
    fixed: list[tuple[str, str]] = []
    for label, how in launch_tools(plan.cluster):
        (plain if how == "plain" else job if how == "job" else fixed).append((label, how))
    # the run's supervisor: python3 on this PATH (not job.env's), as the start script runs it, and
    # in `orch up` what prepare reads with it (the workdir's lock, the agent package); where the
    # host's reach test runs python3 that test says them (reach.tests_by_python: one python3 start
    # per host, not two)
    lines = ["echo \"PATH=$PATH\""]
    if not reach.tests_by_python(plan, host):
        lines.append(python_sh(probe_facts(plan)))
    for label, _ in plain:
        lines.append(f"printf 'plain\\t%s\\t%s\\n' {shlex.quote(label)} \"$(command -v {shlex.quote(label)})\"")
    for label, path in fixed:
        lines.append(f"if [ -x {shlex.quote(path)} ]; then p={shlex.quote(path)}; else p=; fi; "
                     f"printf 'fixed\\t%s\\t%s\\n' {shlex.quote(label)} \"$p\"")
    if job:
        inner = ["echo \"JOBPATH=$PATH\""] + [
            f"printf 'job\\t%s\\t%s\\n' {shlex.quote(label)} \"$(command -v {shlex.quote(label)})\""
            for label, _ in job]
        lines.append(sh.with_env({k: v for k, v in env.items() if k == "PATH"}, "\n".join(inner)))
    return [("path", "\n".join(lines))]


PATH = Probe("path", _shell)

_PATH_HINT_ORTED = ("mpirun starts orted on every host over a non-interactive ssh: add `--prefix <openmpi dir>` "
                    "to job.mpirun_args, or set PATH in the user's ~/.bashrc BEFORE its "
                    "'if not interactive, return' line")


def judge_path(cluster: Cluster, host: Host, sec: Section, supervisor: str | None = None) -> CheckResult:
    """`supervisor`: the python3 version the host's reach test printed (reach.supervisor_version),
    read when the path section has none."""
    info = probes.parse_path(sec.body)
    if info["supervisor"] is None:
        info["supervisor"] = supervisor
    tools = info["tools"]
    env_path = probes.tool_env(cluster, host).get("PATH")
    missing_job, missing_plain, missing_fixed, found = [], [], [], []
    for label, how in launch_tools(cluster):
        path = tools.get(label)
        if path:
            found.append(f"{label}={path}")
        elif how == "job":
            missing_job.append(label)
        elif how == "plain":
            missing_plain.append(label)
        else:
            missing_fixed.append((label, how))
    problems = []
    if not env_path:  # one PATH for everything: say it once
        missing_plain, missing_job = missing_job + missing_plain, []
    if missing_job:
        hint = "fix PATH in job.env" + (", or install Open MPI (mpirun)" if "mpirun" in missing_job else "")
        if env_path and PLAYBOOK_VENVS in env_path:   # the playbooks' venv, which scripts/install-e2e-deps.sh makes
            hint += (f"; {PLAYBOOK_VENVS}... is the venv orch's playbooks use: make it on every host with "
                     "`bash scripts/install-e2e-deps.sh` (in orch's source tree; playbooks/README.md)")
        problems.append(f"{', '.join(missing_job)} not found on job.env PATH={env_path}: {hint}")
    if missing_plain:
        hints = []
        if any(t != "orted" for t in missing_plain):
            hints.append("install it, or set PATH in job.env "
                         "(e.g. PATH: /opt/openmpi/bin:/usr/local/bin:/usr/bin:/bin)")
        if "orted" in missing_plain or "mpirun" in missing_plain:
            hints.append(_PATH_HINT_ORTED)
        problems.append(f"{', '.join(missing_plain)} not found on the non-interactive ssh PATH={info['PATH']}: "
                        + "; ".join(hints))
    for label, path in missing_fixed:
        prefix = mpirun_prefix(cluster.job.mpirun_args)
        why = f" (from mpirun --prefix {prefix})" if label == "orted" and prefix else ""
        problems.append(f"{path} is not an executable on this host{why}")
    if info["supervisor"] is not None:

        sup = python_problem(info["supervisor"])
        if sup:
            problems.append(sup + ": install python3, or put it on the PATH a non-interactive ssh gets")
        else:
            found.insert(0, f"python3={info['supervisor']} (supervisor)")
    if problems:
        return result("path", host, "fail", "; ".join(problems))
    return result("path", host, "pass", " ".join(found) if found else "nothing to look up")


register(Check("path", probes=(PATH,),
               judge=lambda plan, run: [judge_path(plan.cluster, run.host, section(run.sections, "path"),
                                                   reach.supervisor_version(run.sections))]))
