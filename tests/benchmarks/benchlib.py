"""Shared helpers of the cluster-scale benchmarks (not collected by pytest: not test_*.py).

Everything runs against lab hosts (orchestrator/lab/: network namespaces with their own
sshd, 198.18.0.0/16) and this machine only. Each measured command is a child process
reaped with os.wait4, so its wall time, CPU (user+sys, its waited-for children included:
pdsh's and Ansible's ssh processes count) and peak RSS are its own. SSH connections are
counted on the server side, from the "Accepted publickey ... from ADDR" lines each lab
host's sshd writes (LogLevel VERBOSE).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orchestrator.lab import Lab  # noqa: E402 - once sys.path holds the checkout

VENV = Path(os.environ.get("ORCH_BENCH_VENV", "/opt/orch-bench-venv"))
# `python -m orchestrator.cli`, but without the current directory first on sys.path: -m puts it
# there, ahead of PYTHONPATH, so run from the checkout's root (as these benchmarks are) a --before
# SRC (base_env: PYTHONPATH=SRC) imported this checkout's orchestrator, not SRC's: bench_check's
# "before" column was this tree. The real interpreter: no pyenv shim in the numbers.
ORCH = [sys.executable, "-c", "import sys, runpy; sys.path[:1] = [p for p in sys.path[:1] if p]; "
        "runpy.run_module('orchestrator.cli', run_name='__main__', alter_sys=True)"]  # '' is -c's cwd
_ACCEPTED = re.compile(r"Accepted publickey for \S+ from (\S+) port")
_SESSION = re.compile(r"Starting session: \S+ for \S+ from (\S+) port")  # one per command (round trip)


# --------------------------------------------------------------------------- running and measuring


@dataclass
class Measured:
    argv: list[str]
    rc: int
    wall: float
    cpu: float          # user + sys of the process and every child it waited for
    maxrss_kb: int      # peak resident set of the process itself (VmHWM; its children not included)
    stdout: bytes
    stderr: bytes
    own_cpu: float = 0.0  # user + sys of the process alone (its last /proc sample, up to 5 ms before its end)
    # CPU the whole machine spent meanwhile (/proc/stat, all but idle and iowait): the lab hosts'
    # sshd, receivers and ranks run here too, and anything else that ran meanwhile
    machine_cpu: float = 0.0

    def check(self, what: str) -> Measured:
        if self.rc != 0:
            tail = (self.stderr or self.stdout)[-2000:].decode("utf-8", "replace")
            raise RuntimeError(f"{what}: exit code {self.rc}: {tail}")
        return self


def measure(argv: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None,
            timeout: float = 600) -> Measured:
    """Run argv to completion; stdout/stderr go to temporary files (no pipe can stall it).

    Dirty pages are written back first (os.sync): the lab hosts share this machine's disk, and
    the writeback of what the previous command wrote (a first sync to 8 hosts writes 432 MB) would
    otherwise land in whatever is timed next."""
    os.sync()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        busy0 = _machine_busy()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        deadline = t0 + timeout
        hwm, own = 0, 0.0
        while True:
            # ru_maxrss is no use here: a vforked child starts with its parent's high-water mark
            hwm = max(hwm, _vm_hwm_kb(proc.pid))
            own = max(own, _own_cpu(proc.pid))
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.005)
        wall = time.monotonic() - t0
        busy = _machine_busy() - busy0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(list(argv), proc.returncode, wall, ru.ru_utime + ru.ru_stime, hwm, out.read(), err.read(),
                        own, busy)


_TICK = os.sysconf("SC_CLK_TCK")


def _own_cpu(pid: int) -> float:
    """utime + stime of the process alone (not its children), seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            f = fh.read().rsplit(b")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def _machine_busy() -> float:
    """Seconds of CPU all of this machine's CPUs spent so far, idle and iowait left out (/proc/stat)."""
    with open("/proc/stat", "rb") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / _TICK   # user nice system idle iowait irq softirq steal


def _vm_hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def base_env(src: str | None = None, **extra) -> dict:
    """This environment, with orch imported from this tree (or from `src`, else ORCH_BENCH_SRC: a
    before/after comparison runs the same benchmark against another copy of the package)."""
    env = dict(os.environ)
    # bytecode cached, as on a user's machine (pip compiles it; an editable install writes it at
    # the first run): with PYTHONDONTWRITEBYTECODE every orch command compiled its ~70 modules
    # anew, ~0.1-0.2 s of CPU that no user pays and no hand-run has
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    src = src or os.environ.get("ORCH_BENCH_SRC") or str(ROOT)
    env["PYTHONPATH"] = src + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


# --------------------------------------------------------------------------- labs


def lab_up(name: str, n: int, keep: bool = True) -> Lab:
    """A lab with at least n hosts (an existing one of that name is reused)."""
    lab = Lab(name)
    if lab.exists():
        try:
            if len(lab.hosts) >= n and all(s.ok for s in lab.status()):
                return lab
        except Exception:  # noqa: BLE001 - a broken lab of ours is simply remade
            pass
    return lab.up(n)


@dataclass(frozen=True)
class BenchHost:
    lab: Lab
    index: int
    name: str
    address: str

    @property
    def controller(self) -> str:
        """The address this machine has on the host's lab bridge (x.y.K.1)."""
        return self.address.rsplit(".", 1)[0] + ".1"


def lab_hosts(labs: list[Lab], n: int) -> list[BenchHost]:
    out: list[BenchHost] = []
    for lab in labs:
        for h in lab.hosts:
            if len(out) < n:
                out.append(BenchHost(lab, h.index, h.name, h.address))
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} lab hosts, {n} wanted")
    return out


def write_cluster(path: Path, hosts: list[BenchHost], *, slots: int = 2, job: dict | None = None,
                  checks: dict | None = None, ssh: dict | None = None) -> Path:
    """A cluster.yaml with an inline inventory of these lab hosts (several labs allowed)."""
    inv_hosts = []
    for h in hosts:
        inv_hosts.append({"address": h.address, "name": h.name, "identity_file": str(h.lab.key_path),
                          "known_hosts": str(h.lab.known_hosts_path)})
    doc = {
        "inventory": {"defaults": {"user": "root", "port": 22, "slots": slots}, "hosts": inv_hosts},
        "ssh": {"connect_timeout": 10, "command_timeout": 120, "fanout": 64, **(ssh or {})},
        "job": {"workdir": "/data/bench", "command": "hostname", **(job or {})},
    }
    if checks:
        doc["checks"] = checks
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class SshdCounter:
    """Counts "Accepted publickey" lines that sshd logged on each host since `start()`."""

    def __init__(self, hosts: list[BenchHost]):
        self.hosts = hosts
        self.offsets: dict[str, int] = {}

    def start(self) -> SshdCounter:
        for h in self.hosts:
            p = h.lab.sshd_log(h.index)
            self.offsets[h.name] = p.stat().st_size if p.exists() else 0
        return self

    def counts(self, pattern: re.Pattern = _ACCEPTED) -> dict[str, Counter]:
        """{host name: Counter(source address -> accepted connections)} (or other lines: `pattern`)."""
        out = {}
        for h in self.hosts:
            p = h.lab.sshd_log(h.index)
            with open(p, "rb") as fh:
                fh.seek(self.offsets.get(h.name, 0))
                text = fh.read().decode("utf-8", "replace")
            out[h.name] = Counter(pattern.findall(text))
        return out

    def from_controller(self) -> list[int]:
        """Connections each host accepted from this machine (its lab bridge address)."""
        got = self.counts()
        return [got[h.name][h.controller] for h in self.hosts]

    def sessions_from_controller(self) -> list[int]:
        """Commands (SSH sessions: round trips) each host ran for this machine since `start()`."""
        got = self.counts(_SESSION)
        return [got[h.name][h.controller] for h in self.hosts]


def conn_summary(per_host: list[int]) -> str:
    lo, hi = min(per_host), max(per_host)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


# --------------------------------------------------------------------------- baselines


def ssh_base(h: BenchHost) -> list[str]:
    """OpenSSH with the lab's key and known_hosts, never reading ~/.ssh/config, never prompting."""
    return ["ssh", "-F", "/dev/null", "-i", str(h.lab.key_path), "-o", f"UserKnownHostsFile={h.lab.known_hosts_path}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-l", "root"]


def pdsh_available() -> bool:
    return shutil.which("pdsh") is not None


def ansible_bin() -> Path | None:
    p = VENV / "bin" / "ansible"
    return p if p.exists() else None


def pdsh_env(lab: Lab) -> dict:
    return base_env(PDSH_RCMD_TYPE="ssh",
                    PDSH_SSH_ARGS_APPEND=f"-F /dev/null -i {lab.key_path} -o UserKnownHostsFile={lab.known_hosts_path} "
                                         "-o StrictHostKeyChecking=yes -o BatchMode=yes -o LogLevel=ERROR")


def remote_sh(script: str) -> str:
    """The remote command orch sends for a script (transport/ssh.py: `exec sh -c <script>`)."""
    return "exec sh -c " + shlex.quote(script)


@dataclass
class Row:
    cells: dict = field(default_factory=dict)


def fmt(v, unit: str = "", digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-markdown table (also readable as plain text)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731 - a one-line row formatter
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
