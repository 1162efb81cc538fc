"""--vary: per-host tool versions. Parsing `I:TOOL=VERSION`, the shims' text (pure), and a
host's /opt/orch-lab (bin/ shims, lib/ fake libnccl, site/ fake dist-infos) written from them.
What a version means is in the package docs (orchestrator/lab/__init__.py, "Versions")."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..errors import LabError
from .model import HostPlan
from .render import SBIN_PATH
from .system import host_python, listdir, run, which, write

_DIST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")

# OpenMPI executables hidden by openmpi=none.
OPENMPI_EXES = (
    "mpirun", "mpiexec", "orterun", "orted", "ompi_info", "oshrun", "shmemrun",
    "ompi-clean", "orte-clean", "orte-info", "ompi-server", "orte-server",
    "mpirun.openmpi", "mpiexec.openmpi", "opal_wrapper", "mpicc", "mpicxx", "mpic++", "mpiCC",
    "mpif77", "mpif90", "mpifort",
)


# --------------------------------------------------------------------------- pure


def parse_vary(specs: Iterable[str] | Mapping | None) -> dict[int | str, dict[str, str]]:
    """``["2:openmpi=4.0.3", "*:mindspore=2.10.0"]`` (or such a mapping) -> {2: {...}, "*": {...}}."""
    out: dict[int | str, dict[str, str]] = {}
    if not specs:
        return out
    if isinstance(specs, Mapping):
        for key, tools in specs.items():
            idx: int | str = "*" if key in ("*", "all") else key
            if idx != "*":
                try:
                    idx = int(idx)
                except (TypeError, ValueError):
                    raise LabError(f"bad --vary host index {key!r}", hint="use 1..N or '*'") from None
            for tool, version in dict(tools).items():
                _check_tool(tool, str(version))
                out.setdefault(idx, {})[tool.lower()] = str(version)
        return out
    for spec in specs:
        m = re.fullmatch(r"\s*(\*|\d+)\s*:\s*([^=\s]+)\s*=\s*(\S+)\s*", str(spec))
        if not m:
            raise LabError(
                f"bad --vary value {spec!r}",
                hint="expected I:TOOL=VERSION, e.g. 2:openmpi=4.0.3 or '*:mindspore=2.10.0'",
            )
        idx = "*" if m.group(1) == "*" else int(m.group(1))
        _check_tool(m.group(2), m.group(3))
        out.setdefault(idx, {})[m.group(2).lower()] = m.group(3)
    return out


def _check_tool(tool: str, version: str) -> None:
    if not _DIST_RE.fullmatch(tool or ""):
        raise LabError(f"bad tool name {tool!r} in --vary", hint="e.g. openmpi, python, nccl, mindspore, torch")
    if not _VERSION_RE.fullmatch(version or ""):
        raise LabError(f"bad version {version!r} for {tool} in --vary", hint="e.g. 4.0.3, or none")
    if tool.lower() == "python" and version == "none":
        raise LabError("--vary python=none is not supported", hint="a lab host always has this machine's system python3")


def host_versions(vary: Mapping[int | str, Mapping[str, str]], index: int) -> dict[str, str]:
    merged = dict(vary.get("*", {}))
    merged.update(vary.get(index, {}))
    return merged


def _sh_shim(body: str) -> str:
    return "#!/bin/bash\n# orch lab version shim\n" + body


def python_shim(version: str, real: str) -> str:
    return _sh_shim(
        'case "${1:-}" in\n'
        f'  --version|-V) echo {shlex.quote("Python " + version)}; exit 0;;\n'
        "esac\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )


def mpirun_shim(real: str, real_version: str, version: str) -> str:
    sed = "s/" + re.escape(real_version).replace("/", r"\/") + "/" + version + "/g"
    return _sh_shim(
        "set -o pipefail\n"
        'case "${1:-}" in\n'
        f'  --version|-V|-version) {shlex.quote(real)} --version | sed -e {shlex.quote(sed)}; exit;;\n'
        "esac\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )


def ompi_info_shim(real: str, real_version: str, version: str) -> str:
    sed = "s/\\b" + re.escape(real_version) + "\\b/" + version + "/g"
    return _sh_shim(
        "set -o pipefail\n"
        f'{shlex.quote(real)} "$@" | sed -e {shlex.quote(sed)}\n'
    )


def dist_metadata(name: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: orch lab stand-in\n"


def dist_key(name: str) -> str:
    """A distribution name as dist-info dirs spell it (PEP 503-ish, lower-cased by the caller)."""
    return re.sub(r"[-_.]+", "_", name)


# --------------------------------------------------------------------------- this machine


def openmpi_real_version(mpirun: str) -> str:
    res = run([mpirun, "--version"], check=False, timeout=20, what="mpirun --version")
    m = re.search(r"\(Open MPI\)\s+(\S+)", res.stdout + res.stderr)
    if not m:
        raise LabError(f"cannot tell the OpenMPI version from `{mpirun} --version`", hint="is openmpi-bin installed?")
    return m.group(1)


def openmpi_names(pathdirs: Sequence[str]) -> dict[str, list[str]]:
    """real dir -> names in it that run an OpenMPI tool (the names, symlinks included)."""
    targets = set()
    for d in pathdirs:
        for exe in OPENMPI_EXES:
            if os.path.exists(os.path.join(d, exe)):
                targets.add(os.path.realpath(os.path.join(d, exe)))
    out: dict[str, list[str]] = {}
    for d in dict.fromkeys(os.path.realpath(x) for x in pathdirs):
        names = sorted(x for x in listdir(d)
                       if x in OPENMPI_EXES or os.path.realpath(os.path.join(d, x)) in targets)
        if names:
            out[d] = names
    return out


def host_sys_path() -> list[str]:
    """sys.path of the hosts' python3 (system.host_python) as a host runs it: root's HOME,
    the standard PATH, no PYTHONPATH. Read once per `up` (only when a TOOL=none asks)."""
    python = host_python()
    if python not in _SYS_PATH:
        res = run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], timeout=30, cwd="/",
                  env={"HOME": "/root", "PATH": SBIN_PATH, "LC_ALL": "C"}, what=f"{python}: sys.path")
        _SYS_PATH[python] = [x for x in json.loads(res.stdout) if x]
    return _SYS_PATH[python]


_SYS_PATH: dict[str, list[str]] = {}


def installed_dist_dirs(name: str) -> list[Path]:
    """dist-info dirs of `name` the hosts' python3 sees (for name=none hiding)."""
    out = []
    norm = dist_key(name).lower()
    for base in host_sys_path():
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for entry in entries:
            if entry.endswith((".dist-info", ".egg-info")):
                stem = entry.rsplit(".", 1)[0]
                dname = dist_key(stem.split("-")[0]).lower()
                if dname == norm:
                    out.append(Path(base).resolve() / entry)
    return out


def install(p: HostPlan, opt: Path, mpirun: str, real_ompi: str) -> list[Path]:
    """Make host p's /opt/orch-lab (`opt`: bin/, site/, lib/) from its versions; returns the
    dist-info dirs its setup.sh removes (TOOL=none of a distribution installed under /root)."""
    for sub in ("bin", "site", "lib"):
        (opt / sub).mkdir(parents=True)
    hide_dists: list[Path] = []
    for tool, version in sorted(p.versions.items()):
        if tool == "openmpi":
            if version != "none":
                write(opt / "bin" / "mpirun", mpirun_shim(mpirun, real_ompi, version), 0o755)
                write(opt / "bin" / "mpiexec", mpirun_shim(mpirun, real_ompi, version), 0o755)
                ompi_info = which("ompi_info") or "/usr/bin/ompi_info"
                write(opt / "bin" / "ompi_info", ompi_info_shim(ompi_info, real_ompi, version), 0o755)
        elif tool == "python":
            write(opt / "bin" / "python3", python_shim(version, host_python()), 0o755)
            os.symlink("python3", opt / "bin" / "python")
        elif tool == "nccl":
            if version != "none":
                lib = opt / "lib" / f"libnccl.so.{version}"
                write(lib, "")
                os.symlink(lib.name, opt / "lib" / f"libnccl.so.{version.split('.')[0]}")
        elif version == "none":
            for dist in installed_dist_dirs(tool):
                if Path("/root") not in dist.parents:
                    raise LabError(
                        f"cannot hide {tool} on {p.host.name}: it is installed at {dist}, outside /root",
                        hint=f"drop --vary {p.host.index}:{tool}=none or uninstall {tool}",
                    )
                hide_dists.append(dist)
        else:
            info = opt / "site" / f"{dist_key(tool)}-{version}.dist-info"
            info.mkdir()
            write(info / "METADATA", dist_metadata(tool, version))
            write(info / "INSTALLER", "orch-lab\n")
    return hide_dists
