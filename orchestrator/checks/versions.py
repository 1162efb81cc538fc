"""versions: the same version of each tool (python, Open MPI, MindSpore, torch, CANN, NCCL, the
NVIDIA driver) on every host; the ones the launch needs installed. Judged across hosts; a host
whose output cannot be read gets an error of its own."""

from __future__ import annotations

import shlex
from typing import Mapping, Sequence

from .. import probes, sh
from ..probes import DIST_TOOLS, NCCL_DISTS, NOT_INSTALLED, ASCEND_TOOLKIT, ProbeError, Section
from ..hostsets import fold
from ..model import Host
from .base import Check, CheckResult, Missing, Probe, register, section

_DISTS_PY = ("import sys\n"
             "try:\n import importlib.metadata as m\n"
             "except ImportError:\n import importlib_metadata as m\n"
             "for d in sys.argv[1:]:\n"
             " try: print(d, m.version(d))\n"
             " except Exception: print(d, '-')\n")


def python_version(python: str) -> str:
    """ver:python's commands for the interpreter `python` (reach.given: the test's python3 prints
    what they print for python3 with no tool environment)."""
    qpy = shlex.quote(python)
    return f"if command -v {qpy} >/dev/null 2>&1; then $T {qpy} --version 2>&1; else echo {NOT_INSTALLED}; fi"


def _shell(plan, host: Host) -> list[tuple[str, str]]:
    tools = list(plan.tools)
    env = probes.tool_env(plan.cluster, host)
    out = []
    qpy = shlex.quote(probes.interpreter(plan.cluster))
    if "python" in tools:
        out.append(("ver:python", python_version(probes.interpreter(plan.cluster))))
    dists = [t for t in tools if t in DIST_TOOLS] + (list(NCCL_DISTS) if "nccl" in tools else [])
    if dists:
        out.append(("ver:dists", f"if command -v {qpy} >/dev/null 2>&1; then $T {qpy} -c {shlex.quote(_DISTS_PY)} "
                                 f"{' '.join(dists)}; else echo {NOT_INSTALLED}; fi"))
    if "openmpi" in tools:
        out.append(("ver:openmpi", "if command -v mpirun >/dev/null 2>&1; then $T mpirun --version 2>&1\n"
                                   "elif command -v ompi_info >/dev/null 2>&1; then $T ompi_info --version 2>&1\n"
                                   f"else echo {NOT_INSTALLED}; fi"))
    if "nccl" in tools:
        out.append(("ver:nccl", "f=\nl=$(command -v ldconfig || echo /sbin/ldconfig)\n"
                                "for p in $(\"$l\" -p 2>/dev/null | sed -n 's/.*libnccl\\.so[^ ]* .*=> //p'); do "
                                "echo \"$p -> $(readlink -f \"$p\")\"; f=1; done\n"
                                "for p in $(echo \"$LD_LIBRARY_PATH\" | tr ':' ' '); do for q in \"$p\"/libnccl.so.*; "
                                "do [ -e \"$q\" ] && echo \"$q\" && f=1; done; done\n"
                                "for h in ${CUDA_HOME:+\"$CUDA_HOME\"/include/nccl.h} /usr/include/nccl.h "
                                "/usr/local/cuda/include/nccl.h; do [ -f \"$h\" ] && { echo \"# $h\"; "
                                "grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' \"$h\"; f=1; break; }; done\n"
                                f"[ -n \"$f\" ] || echo {NOT_INSTALLED}"))
    if "cann" in tools:
        out.append(("ver:cann", f"f=\nfor i in \"${{ASCEND_TOOLKIT_HOME:-{ASCEND_TOOLKIT}}}\"/*/"
                                "ascend_toolkit_install.info \"${ASCEND_TOOLKIT_HOME:-"
                                f"{ASCEND_TOOLKIT}}}\"/ascend_toolkit_install.info \"${{ASCEND_TOOLKIT_HOME:-"
                                f"{ASCEND_TOOLKIT}}}\"/*/version.cfg; do "
                                "[ -f \"$i\" ] && { echo \"# $i\"; cat \"$i\"; f=1; break; }; done\n"
                                f"[ -n \"$f\" ] || echo {NOT_INSTALLED}"))
    if "cuda-driver" in tools:
        out.append(("ver:cuda-driver", "if [ -r /proc/driver/nvidia/version ]; then cat /proc/driver/nvidia/version\n"
                                       "elif command -v nvidia-smi >/dev/null 2>&1; then $T nvidia-smi "
                                       "--query-gpu=driver_version --format=csv,noheader 2>&1\n"
                                       f"else echo {NOT_INSTALLED}; fi"))
    return [(n, sh.with_env(env, b)) for n, b in out]


VERSIONS = Probe("versions", _shell)


def host_versions(sections: Mapping[str, Section], tools: Sequence[str]) -> dict[str, str | None]:
    """One host's {tool: version or None (not installed)} from its probe sections."""
    out: dict[str, str | None] = {}
    dists: dict[str, str | None] = {}
    want_dists = [t for t in tools if t in DIST_TOOLS] + (list(NCCL_DISTS) if "nccl" in tools else [])
    if want_dists:
        dists = probes.parse_dists(section(sections, "ver:dists").body, want_dists)
    for t in tools:
        if t == "python":
            out[t] = probes.parse_python_version(section(sections, "ver:python").body)
        elif t == "openmpi":
            out[t] = probes.parse_openmpi_version(section(sections, "ver:openmpi").body)
        elif t in DIST_TOOLS:
            out[t] = dists[t]
        elif t == "nccl":
            out[t] = probes.parse_nccl_version(section(sections, "ver:nccl").body, dists)
        elif t == "cann":
            out[t] = probes.parse_cann_version(section(sections, "ver:cann").body)
        elif t == "cuda-driver":
            out[t] = probes.parse_cuda_driver_version(section(sections, "ver:cuda-driver").body)
    return out


def _vkey(v: str | None):
    if v is None:
        return None
    from packaging.version import InvalidVersion, Version

    try:
        return Version(v)  # 2.10 == 2.10.0
    except InvalidVersion:
        return v.strip()


def judge_versions(per_host: Mapping[str, Mapping[str, str | None]], tools: Sequence[str],
                   needed: Sequence[str], launcher: str = "mpirun") -> list[CheckResult]:
    """{host: {tool: version|None}} (hosts in plan order) -> cluster-wide results (pure).

    One fail per mismatching tool, naming each version with its folded host set."""
    hosts = list(per_host)
    if not hosts:
        return []
    out: list[CheckResult] = []
    same: list[str] = []
    for t in tools:
        groups: dict = {}
        shown: dict = {}
        for h in hosts:
            v = per_host[h].get(t)
            k = _vkey(v)
            groups.setdefault(k, []).append(h)
            shown.setdefault(k, v)
        if len(groups) > 1:
            order = sorted(groups, key=lambda k: (k is None, -len(groups[k]), str(k)))
            parts = [(f"not installed on {fold(groups[k])}" if k is None else f"{shown[k]} on {fold(groups[k])}")
                     for k in order]
            out.append(CheckResult("versions", None, "fail", f"{t}: " + "; ".join(parts), tuple(hosts)))
            continue
        (k, members), = groups.items()
        if k is None:
            if t in needed:
                why = {"openmpi": f"the {launcher} launcher needs Open MPI", "mindspore": "the job needs MindSpore",
                       "python": "the job runs python"}.get(t, "the platform needs it")
                out.append(CheckResult("versions", None, "fail", f"{t}: not installed on any host "
                                       f"({fold(members)}); {why}", tuple(hosts)))
            else:
                out.append(CheckResult("versions", None, "warn", f"{t}: not installed on any host ({fold(members)})",
                                       tuple(hosts)))
            continue
        if t == "openmpi" and launcher == "mpirun" and not str(k)[0].isdigit():
            out.append(CheckResult("versions", None, "fail", f"openmpi: mpirun is {shown[k]} on {fold(members)}, "
                                   "not Open MPI; orch's mpirun launcher needs Open MPI", tuple(hosts)))
            continue
        same.append(f"{t} {shown[k]}")
    if same:
        out.insert(0, CheckResult("versions", None, "pass", f"{', '.join(same)} on {fold(hosts)}", tuple(hosts)))
    return out


def _judge(plan, run) -> list[CheckResult]:
    """Nothing of its own for a host that answered (versions are judged across hosts), but an
    error when its output cannot be read."""
    host_versions(run.sections, plan.tools)
    return []


def _across(plan, runs) -> list[CheckResult]:
    per_host = {}
    for r in runs:
        try:
            per_host[r.host.name] = host_versions(r.sections, plan.tools)
        except (ProbeError, Missing):
            pass  # already an error result of that host
    return judge_versions(per_host, plan.tools, plan.needed, plan.cluster.job.launcher)


register(Check("versions", probes=(VERSIONS,), judge=_judge, across=_across))
