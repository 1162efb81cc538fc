"""This machine, as the lab uses it: the tools it needs (preflight), running them (run; nsenter_run
never orphans a host's process), a small thread pool, and file helpers."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import LabError
from . import pids
from .model import HOST_PRIVATE, host_visible
from .render import SBIN_PATH

# Which Debian package brings each tool the lab runs.
TOOLS = {
    "ip": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "mount": "mount",
    "umount": "mount",
    "sshd": "openssh-server",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "mpirun": "openmpi-bin",
}
# ... and those of a Slurm lab (orch lab up --slurm; slurm.py)
SLURM_TOOLS = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sinfo": "slurm-client", "munged": "munge"}
UP_TOOLS = tuple(TOOLS)
DOWN_TOOLS = ("ip",)


def host_python() -> str:
    """The python3 lab hosts run: the first python3 on their standard PATH (SBIN_PATH), this
    machine's system python3 (Debian's /usr/bin/python3), with its standard library and
    nothing of the controller's. Never the python running orch (a venv, pyenv): a real host has
    only its own python3, so orch, paramiko or pydantic must not be importable on a lab host,
    or code that imports them there would pass in the lab and fail on a cluster. It is what
    ``python3`` runs over ssh (unless a ``--vary I:python=X`` shim comes first), the lab's init
    and the real interpreter behind that shim."""
    found = shutil.which("python3", path=SBIN_PATH)
    if found is None:
        raise LabError(f"orch lab needs this machine's system python3 (none in {SBIN_PATH}): lab hosts run it, "
                       "never the python that runs orch",
                       hint="install it: apt-get install python3")
    path = os.path.abspath(found)
    if not host_visible(path) or re.search(r"\s", path) or len(path) > 200:
        raise LabError(f"lab hosts cannot run the system python3 {path}: hosts mount their own "
                       f"{', '.join(HOST_PRIVATE)}, and a #! line takes no spaces",
                       hint="install python3 in /usr/bin: apt-get install python3")
    return path


def which(tool: str) -> str | None:
    path = os.environ.get("PATH", "") + ":" + SBIN_PATH
    return shutil.which(tool, path=path)


def preflight(tools: Sequence[str] = UP_TOOLS) -> dict[str, str]:
    """Linux, root and the tools; returns tool -> path. Raises LabError naming the package."""
    if not sys.platform.startswith("linux"):
        raise LabError(
            f"orch lab needs Linux (network namespaces); this is {sys.platform}",
            hint="run the lab on a Linux machine or VM",
        )
    if os.geteuid() != 0:
        raise LabError(
            "orch lab needs root (it creates network namespaces, a bridge and bind mounts)",
            hint="run it as root, e.g. sudo orch lab ...",
        )
    found: dict[str, str] = {}
    missing = []
    for tool in tools:
        path = which(tool)
        if path is None:
            missing.append(tool)
        else:
            found[tool] = path
    if missing:
        pkgs = sorted({TOOLS.get(t) or SLURM_TOOLS[t] for t in missing})
        raise LabError(
            f"orch lab needs {', '.join(missing)}, not found on PATH",
            hint="install it: apt-get install " + " ".join(pkgs),
        )
    return found


def run(argv: Sequence[str], *, input: str | None = None, timeout: float = 60, check: bool = True,
        what: str | None = None, **kw) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise LabError(f"{what or argv[0]}: timed out after {timeout:g}s: {shlex.join(argv)}") from None
    except OSError as exc:
        raise LabError(f"{what or argv[0]}: cannot run {argv[0]}: {exc}") from None
    if check and res.returncode != 0:
        detail = (res.stderr or res.stdout).strip().splitlines()
        raise LabError(
            f"{what or shlex.join(argv)} failed (exit {res.returncode})"
            + (f": {' / '.join(detail[-3:])}" if detail else "")
        )
    return res


def nsenter_run(argv: Sequence[str], *, input: str | None = None, timeout: float = 60,
                env: Mapping[str, str] | None = None, what: str | None = None) -> subprocess.CompletedProcess:
    """subprocess.run for ``nsenter -p ...`` (text, captured), never orphaning nsenter's child.

    nsenter stays out here and forks the command into the host's PID namespace. Were nsenter
    killed first (subprocess.run's timeout does that), its child would be reparented to this
    machine's PID 1, which the host's init cannot reap and which might never reap it. So on a
    timeout or an interrupt the child is killed first and nsenter, which then exits, is waited for.
    """
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException as exc:
        deadline = time.monotonic() + 5
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                break
            for child in pids.children(proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
            time.sleep(0.01)
        for fh in (proc.stdin, proc.stdout, proc.stderr):
            if fh:
                with contextlib.suppress(OSError):
                    fh.close()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise LabError(f"{what or argv[0]} timed out after {timeout:g}s") from None
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def parallel(fn, items: Sequence, workers: int = 16) -> list:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def write(path: Path, text: str, mode: int = 0o644) -> None:
    """`text` into `path` atomically: a new file (mkstemp: 0600, a random name) given `mode`, then
    renamed over the old one, so a private key is never readable by others, even for a moment."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
