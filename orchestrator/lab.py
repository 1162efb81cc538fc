"""The simulated cluster: N "hosts" on this one Linux machine, for real multi-host tests.

`orch lab up 4` makes four hosts that look like separate machines to everything orch
does over SSH: each has its own network namespace (address 198.18.K.(10+i) on a
bridge), hostname, real sshd on port 22 (or --ssh-port), /data, /tmp, /etc/hccn.conf, /etc/hosts
(every lab host's name), /root and /root/.ssh. Needs root on Linux and iproute2,
util-linux, openssh-server/-client and openmpi-bin.

/root on a host is an overlay (tmpfs upper, this machine's /root below): writes stay
on that host, and /root/.ssh is bound from the state dir without creating (or
reading) the real /root/.ssh.

Layout (NAME defaults to ``lab``; ORCH_LAB_ROOT defaults to /var/tmp/orch-lab)::

    $ORCH_LAB_ROOT/NAME/
        lab.json            machine-readable state (hosts, pids, subnet, mountpoints)
        inventory.yaml      usable unchanged as `inventory:` in a cluster.yaml
        id_ed25519(.pub)    the lab's user key (root on every host accepts it)
        known_hosts         every host's address and name with its host key
        ssh_config          OpenSSH client config: every host by its name (ProxyJump with --bastion)
        passwd, group       with --user: the copies bound over /etc/passwd and /etc/group
        h<i>/               host i: sshd_config, sshd.log, sshd.pid, host key,
                            data/ (-> /data), ssh/ (-> /root/.ssh), opt/ (-> /opt/orch-lab),
                            tmp/ (-> /tmp), hccn.conf, hosts, bashrc, setup.sh,
                            home/ (-> /home/USER with --user); h0/ is the bastion's

Network: bridge ``ol-br-NAME`` in the root namespace holds 198.18.K.1/24 (K is derived
from NAME, recorded in lab.json, and never shared by two labs); host i is netns
``olab-NAME-i`` with ``eth0`` = 198.18.K.(10+i), its root-side veth is ``olNAME-i``.
Hosts have no default route: they reach each other and the controller, nothing else.

Options (orchestrator/labnet.py has the details), each recorded in lab.json:
  --ssh-port P  (``ssh_port``) every sshd listens on P; the inventory says ``port: P`` and the
                lab's known_hosts lists ``[address]:P`` / ``[name]:P``.
  --user NAME   (``user``) every host has an ordinary user NAME (uid/gid 4300, home /home/NAME,
                owner of /data) from per-host copies of /etc/passwd and /etc/group; the inventory
                says ``user: NAME``; root login still works (``Lab.ssh(i, cmd, user=NAME)``).
  --bastion     (``bastion``: its record, with the hosts' subnet ``k``/``subnet`` and bridge) the
                hosts sit on bridge ``ol-bh-NAME`` (198.18.M.0/24, M reserved like K, an
                ``unreachable`` route to it here) that this machine has no address on; host 0,
                ``NAME-bastion`` (netns ``olab-NAME-0``, veths ``olNAME-0`` on ol-br-NAME and
                ``olNAME-0b`` on ol-bh-NAME, no IP forwarding), is the only way in. The inventory
                gets ``jump: USER@BASTION:PORT``; ``Lab.ssh_config_path`` (ssh -F FILE NAME-h1)
                names every host with ProxyJump to the bastion. ``Lab.exec/ssh/sshd/link(0, ...)``,
                status and down cover the bastion.

Each host's uts+mount+pid namespaces are kept alive by a holder process, ``orch-lab-init``
(the state dir's tiny python init, started as ``ip netns exec olab-NAME-i unshare --uts
--mount --pid sh -c 'sh h<i>/setup.sh &'``: setup.sh is PID 1 of the host's new PID
namespace, mounts a fresh /proc, sets the address, hostname and bind mounts, then execs
the init). So a host has its own PID namespace like a real machine: ``ps -e`` or a /proc
scan on host 2 (over ssh or ``Lab.exec``) sees only host 2's processes, signalling
"every process with ORCH_RUN_ID=x" on one host cannot touch another host's, and the
init reaps every orphan of the host the moment it exits (no zombies left behind by
``setsid`` daemons that are killed). sshd is started inside those namespaces with
``nsenter -t <holder> -n -u -m -p`` (nsenter forks, so sshd is in the host's PID
namespace and, once daemonised, a child of the init), so ``orch lab sshd stop|start``
keeps the same host. ``orch lab down`` SIGKILLs the init (which takes every process of
the host with it) and, as a safety net, every process in the lab's network, mount or PID
namespaces (sshd sessions, daemons started over ssh with setsid...), deletes the veths,
bridge and namespaces, the state dir, and the mountpoints it created on the real root fs
(/data, /etc/hccn.conf, /opt/orch-lab, /run/sshd, the /run/netns mount) once no other
lab is left.

PIDs: lab.json (holder_pid, sshd_pid), ``Lab.status()`` and ``orch lab status`` give
pids as this machine's root PID namespace sees them (usable with kill/ps out here);
h<i>/sshd.pid (sshd's own PidFile) and every pid seen on a host (``echo $!`` over ssh,
``ps`` via ``Lab.exec``) are host-local, the init being PID 1. ``Lab.root_pid(i, pid)``
turns a host-local pid into the root-namespace one. The process ``Lab.exec`` (or
``lab sshd start``) runs has its parent, nsenter, outside the host; so on a timeout or an
interrupt it is killed before nsenter, never orphaned to this machine's PID 1: the host's
init could not reap it, and a PID namespace's dying init waits until all its processes
are reaped (daemons it forks are the init's, as usual).

PATH on a host (non-interactive ssh): sshd reads the per-host /root/.ssh/environment
(PermitUserEnvironment yes), which sets
``PATH=/opt/orch-lab/bin:<dir of sys.executable>:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``
(plus PYTHONPATH=/opt/orch-lab/site / LD_LIBRARY_PATH=/opt/orch-lab/lib where a
--vary put something there). So ``python3`` over ssh is the very interpreter that ran
``orch lab up`` (with its site-packages; a checkout under /tmp is not visible: /tmp is per host)
unless ``--vary I:python=X`` puts a version shim first. Because bash sources
~/.bashrc for ssh commands and this machine's /root/.bashrc prepends pyenv shims,
each host's /root/.bashrc (in its /root overlay; the real file is untouched) returns
early for non-interactive shells.

Versions (``--vary I:TOOL=VERSION``, ``--vary '*:TOOL=VERSION'`` or ``--all TOOL=VERSION``;
a host's own entry wins over ``*``):
  openmpi=V   /opt/orch-lab/bin/{mpirun,mpiexec,ompi_info} shims print the real output
              with the version replaced; anything else runs the real tool.
  openmpi=none  every OpenMPI executable name (mpirun, orted, ompi_info, mpicc...) is
              removed from the PATH dirs inside that host's mount namespace (a tmpfs
              overlay over /usr/bin with whiteouts): ``command -v mpirun`` fails.
              (Covering the files with a non-executable bind mount is not enough:
              bash's ``command -v`` still prints a non-executable match.)
  python=V    /opt/orch-lab/bin/python3 (and python) answer --version/-V with V.
  nccl=V      empty /opt/orch-lab/lib/libnccl.so.V + libnccl.so.<major> symlink.
  other=V     any Python distribution (mindspore, torch...): a fake
              /opt/orch-lab/site/<name>-V.dist-info/METADATA.
  other=none  no shim; if this machine's python has it installed under /root, its
              dist-info is removed inside that host's /root overlay.

mpirun across lab hosts works with the stock ssh agent, run on a lab host::

    ssh root@198.18.K.11 mpirun --allow-run-as-root -H 198.18.K.11:1,198.18.K.12:1 -n 2 hostname

(the per-host ~/.ssh/config has BatchMode yes, the lab key and every host's key, and
orted is on the non-interactive PATH, so no -mca plm_rsh_args or --prefix is needed;
an MPI_Allreduce over btl tcp between two hosts works as is, or pinned with
``-mca btl tcp,self -mca btl_tcp_if_include eth0 -mca oob_tcp_if_include eth0``.)

Quirks worth knowing: sshd daemonises before it binds, so readiness is its PidFile
(written after listen); sshd -E sends even config errors to the log file, not stderr;
``ip netns add`` turns /run/netns into a shared bind mount the first time (recorded and
undone by the last ``down``); unlinking a mountpoint in the root namespace silently
unmounts it in every other namespace, hence the shared, locked mountpoint registry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import click

from . import labnet, labslurm
from .errors import LabError

DEFAULT_ROOT = "/var/tmp/orch-lab"
NAME_RE = re.compile(r"[a-z0-9]{1,8}")
MAX_HOSTS = 240  # .11 .. .250 of the lab's /24
SUBNET_PREFIX = "198.18"
SSH_PORT = 22
SLOTS = 2
HOST_PREFIX = 10  # host i has .(10+i)
REGISTRY = "mountpoints.json"
STATE_VERSION = 1

# Which Debian package brings each tool the lab runs.
_TOOLS = {
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
_UP_TOOLS = tuple(_TOOLS)
_DOWN_TOOLS = ("ip",)
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Real-fs paths a host's mount namespace binds over; created (and later removed) only
# when missing. /root/.ssh is NOT here: it is made inside the host's /root overlay.
_MOUNTPOINT_DIRS = ("/data", "/opt/orch-lab", "/run/sshd")
_MOUNTPOINT_FILES = ("/etc/hccn.conf",)
_NETNS_DIR = "/run/netns"

# OpenMPI executables hidden by openmpi=none.
_OPENMPI_EXES = (
    "mpirun", "mpiexec", "orterun", "orted", "ompi_info", "oshrun", "shmemrun",
    "ompi-clean", "orte-clean", "orte-info", "ompi-server", "orte-server",
    "mpirun.openmpi", "mpiexec.openmpi", "opal_wrapper", "mpicc", "mpicxx", "mpic++", "mpiCC",
    "mpif77", "mpif90", "mpifort",
)
# PID 1 of every lab host's PID namespace: h<i>/setup.sh execs <state dir>/orch-lab-init
# (a python script, so its comm is this name). "sleep" is what older labs hold with.
HOLDER_COMM = "orch-lab-init"
_HOLDER_COMMS = (HOLDER_COMM, "sleep")

_DIST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")


# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class LabHost:
    """One simulated host. index is 1-based."""

    index: int
    name: str
    address: str
    netns: str
    veth: str


@dataclass(frozen=True)
class HostStatus:
    """holder_pid and sshd_pid are pids in this machine's root PID namespace (not the host's);
    sshd_pid is None unless sshd runs."""

    host: LabHost
    netns: bool
    holder_pid: int | None
    holder_alive: bool
    sshd_pid: int | None
    sshd_alive: bool
    link_up: bool

    @property
    def ok(self) -> bool:
        return self.netns and self.holder_alive and self.sshd_alive and self.link_up


@dataclass
class _HostPlan:
    host: LabHost
    dir: Path
    versions: dict[str, str] = field(default_factory=dict)
    refuse_key: bool = False
    back_address: str | None = None  # the bastion's address on the hosts' bridge (bastion only)


# --------------------------------------------------------------------------- pure helpers


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise LabError(
            f"bad lab name {name!r}",
            hint="a lab name is 1-8 characters of a-z and 0-9, e.g. --name t1",
        )
    return name


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
        raise LabError("--vary python=none is not supported", hint="a lab host always has this machine's python")


def host_versions(vary: Mapping[int | str, Mapping[str, str]], index: int) -> dict[str, str]:
    merged = dict(vary.get("*", {}))
    merged.update(vary.get(index, {}))
    return merged


def subnet_octet(name: str) -> int:
    """The lab's preferred third octet, 1..250, stable from its name."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 250 + 1


def hccn_conf(index: int, devices: int = 8) -> str:
    """Text of a host's /etc/hccn.conf: one subnet per device index, one address per host."""
    lines = []
    for d in range(devices):
        lines.append(f"address_{d}=192.168.{100 + d}.{HOST_PREFIX + index}")
        lines.append(f"netmask_{d}=255.255.255.0")
    return "\n".join(lines) + "\n"


def inventory_yaml(name: str, subnet: str, hosts: Sequence[LabHost], key: Path, known_hosts: Path, *,
                   user: str = "root", port: int = SSH_PORT, jump: str | None = None) -> str:
    """`jump` (USER@ADDRESS:PORT of a bastion) goes into the defaults: every host is behind it."""
    extra = f", jump: {labnet.yaml_str(jump)}" if jump else ""
    lines = [
        f"# orch lab {name!r}: {len(hosts)} simulated hosts on {subnet}; made by `orch lab up`,",
        "# removed by `orch lab down`. Usable unchanged as `inventory:` in a cluster.yaml.",
        f"defaults: {{user: {labnet.yaml_str(user)}, port: {port}, identity_file: {key}, "
        f"known_hosts: {known_hosts}, slots: {SLOTS}{extra}}}",
        "hosts:",
    ]
    lines += [f"  - {{address: {h.address}, name: {h.name}}}" for h in hosts]
    return "\n".join(lines) + "\n"


def host_path_env(pydir: str, site: bool, lib: bool) -> str:
    """Contents of a host's ~/.ssh/environment."""
    parts = ["/opt/orch-lab/bin"]
    if pydir not in parts:
        parts.append(pydir)
    for p in _SBIN_PATH.split(":"):
        if p not in parts:
            parts.append(p)
    out = [f"PATH={':'.join(parts)}"]
    if site:
        out.append("PYTHONPATH=/opt/orch-lab/site")
    if lib:
        out.append("LD_LIBRARY_PATH=/opt/orch-lab/lib")
    return "\n".join(out) + "\n"


def sshd_config(host: LabHost, hdir: Path, port: int = SSH_PORT, max_startups: str = "200:30:400") -> str:
    return "\n".join([
        f"# sshd of orch lab host {host.name}",
        f"ListenAddress {host.address}",
        f"Port {port}",
        f"HostKey {hdir}/ssh_host_ed25519_key",
        f"PidFile {hdir}/sshd.pid",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "AuthorizedKeysFile .ssh/authorized_keys",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PermitUserEnvironment yes",
        f"MaxStartups {max_startups}",
        "MaxSessions 200",
        "LogLevel VERBOSE",
        "UseDNS no",
        "PrintMotd no",
        "X11Forwarding no",
        "AcceptEnv LANG LC_*",
        "Subsystem sftp internal-sftp",
        "",
    ])


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


def init_script(python: str) -> str:
    """Text of <state dir>/orch-lab-init: a host's PID 1, reaping every orphan as it exits.

    Its stdio (the pipe `orch lab up` reads "ready" from) is closed only once it runs, so
    an EOF on that pipe means the exec is done. SIGKILL from `down` ends it at once (and
    the kernel then kills everything else in its PID namespace).
    """
    return (
        f"#!{python} -IS\n"
        "# orch lab: PID 1 of a lab host's PID namespace; reaps every orphan of the host.\n"
        "import os\n"
        "try:\n"
        "    import _signal as sig  # what `signal` wraps, without its enum import: a faster start\n"
        "except ImportError:\n"
        "    import signal as sig\n"
        "fd = os.open('/dev/null', os.O_RDWR)\n"
        "for n in (0, 1, 2):\n"
        "    os.dup2(fd, n)\n"
        "if fd > 2:\n"
        "    os.close(fd)\n"
        "sig.pthread_sigmask(sig.SIG_BLOCK, {sig.SIGCHLD})\n"
        "while True:\n"
        "    try:\n"
        "        while os.waitpid(-1, os.WNOHANG)[0]:\n"
        "            pass\n"
        "    except ChildProcessError:\n"
        "        pass\n"
        "    sig.sigtimedwait({sig.SIGCHLD}, 60)\n"
    )


def dist_metadata(name: str, version: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: orch lab stand-in\n"


# --------------------------------------------------------------------------- system helpers


def _which(tool: str) -> str | None:
    path = os.environ.get("PATH", "") + ":" + _SBIN_PATH
    return shutil.which(tool, path=path)


def preflight(tools: Sequence[str] = _UP_TOOLS) -> dict[str, str]:
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
        path = _which(tool)
        if path is None:
            missing.append(tool)
        else:
            found[tool] = path
    if missing:
        pkgs = sorted({_TOOLS.get(t) or labslurm.TOOLS[t] for t in missing})
        raise LabError(
            f"orch lab needs {', '.join(missing)}, not found on PATH",
            hint="install it: apt-get install " + " ".join(pkgs),
        )
    return found


def _run(argv: Sequence[str], *, input: str | None = None, timeout: float = 60, check: bool = True,
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


def _nsenter_run(argv: Sequence[str], *, input: str | None = None, timeout: float = 60,
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
            for child in _children(proc.pid):
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


def _parallel(fn, items: Sequence, workers: int = 16) -> list:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def _pid_alive(pid: int | None, comm: str | None = None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else ""
    if state in ("Z", "X"):
        return False
    if comm is not None:
        name = stat[stat.find("(") + 1: stat.rfind(")")]
        return name == comm
    return True


def _holder_alive(pid: int | None) -> bool:
    return any(_pid_alive(pid, comm) for comm in _HOLDER_COMMS)


def _nspid(pid: int) -> int | None:
    """pid's number in its own (innermost) PID namespace, from the NSpid line of its status."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children(pid: int) -> list[int]:
    """pid's child processes (needs CONFIG_PROC_CHILDREN; else a scan of PPid lines)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        pass
    out = []
    for p in _proc_pids():
        try:
            with open(f"/proc/{p}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        with contextlib.suppress(IndexError, ValueError):
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(p)
    return out


def _root_pid(holder: int, nspid: int) -> int | None:
    """The pid (as this process sees it) of the process that is `nspid` in holder's PID namespace."""
    ns = _ns_inode(f"/proc/{holder}/ns/pid")
    if ns is None:
        return None
    if ns == _ns_inode("/proc/self/ns/pid"):  # a holder without a PID namespace of its own (older labs)
        return nspid if _pid_alive(nspid) else None
    if nspid == 1:
        return holder
    seen = set()
    # daemons are children of the init; anything else (an nsenter child...) needs the full scan
    for group in (_children(holder), _proc_pids()):
        for pid in group:
            if pid in seen:
                continue
            seen.add(pid)
            if _nspid(pid) == nspid and _ns_inode(f"/proc/{pid}/ns/pid") == ns:
                return pid
    return None


def _ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _proc_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(root: Path, timeout: float = 60.0):
    """Exclusive lock on the lab root (subnets and the shared mountpoint registry)."""
    deadline = time.monotonic() + timeout
    while True:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise LabError(
                        f"another orch lab command holds the lock on {root} for over {timeout:g}s",
                        hint="wait for it to finish",
                    ) from None
                time.sleep(0.05)
        try:
            same = os.stat(root).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the root was removed while we waited: start over
    try:
        yield
    finally:
        os.close(fd)


def _openmpi_real_version(mpirun: str) -> str:
    res = _run([mpirun, "--version"], check=False, timeout=20, what="mpirun --version")
    m = re.search(r"\(Open MPI\)\s+(\S+)", res.stdout + res.stderr)
    if not m:
        raise LabError(f"cannot tell the OpenMPI version from `{mpirun} --version`", hint="is openmpi-bin installed?")
    return m.group(1)


def _openmpi_names(pathdirs: Sequence[str]) -> dict[str, list[str]]:
    """real dir -> names in it that run an OpenMPI tool (the names, symlinks included)."""
    targets = set()
    for d in pathdirs:
        for exe in _OPENMPI_EXES:
            if os.path.exists(os.path.join(d, exe)):
                targets.add(os.path.realpath(os.path.join(d, exe)))
    out: dict[str, list[str]] = {}
    for d in dict.fromkeys(os.path.realpath(x) for x in pathdirs):
        names = sorted(x for x in _listdir(d)
                       if x in _OPENMPI_EXES or os.path.realpath(os.path.join(d, x)) in targets)
        if names:
            out[d] = names
    return out


def _installed_dist_dirs(name: str) -> list[Path]:
    """dist-info dirs of `name` visible to this python (for name=none hiding)."""
    out = []
    norm = re.sub(r"[-_.]+", "_", name).lower()
    for base in sys.path:
        try:
            entries = os.listdir(base or ".")
        except OSError:
            continue
        for entry in entries:
            if entry.endswith((".dist-info", ".egg-info")):
                stem = entry.rsplit(".", 1)[0]
                dname = re.sub(r"[-_.]+", "_", stem.split("-")[0]).lower()
                if dname == norm:
                    out.append(Path(base or ".").resolve() / entry)
    return out


# --------------------------------------------------------------------------- the lab


class Lab:
    """A named simulated cluster. ``Lab("t1").up(3)``; ``.down()`` removes everything."""

    def __init__(self, name: str = "lab", root: str | os.PathLike | None = None):
        self.name = validate_name(name)
        self.root = Path(root or os.environ.get("ORCH_LAB_ROOT") or DEFAULT_ROOT).absolute()
        self.state_dir = self.root / self.name

    def __repr__(self) -> str:
        return f"Lab(name={self.name!r}, state_dir={str(self.state_dir)!r})"

    # ---- names and paths

    @property
    def bridge(self) -> str:
        """This machine's bridge (198.18.K.1): the hosts', or the bastion's front with --bastion."""
        return f"ol-br-{self.name}"

    @property
    def hosts_bridge_name(self) -> str:
        """The bridge of the hosts behind a bastion (no address of this machine on it)."""
        return f"ol-bh-{self.name}"

    def netns_name(self, i: int) -> str:
        return f"olab-{self.name}-{i}"

    def veth_name(self, i: int) -> str:
        return f"ol{self.name}-{i}"

    def host_name(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def host_dir(self, i: int) -> Path:
        """Host i's files; h0 is the bastion's."""
        return self.state_dir / f"h{i}"

    def bastion_name(self) -> str:
        return f"{self.name}-bastion"

    def back_veth_name(self) -> str:
        """Root-side veth of the bastion's NIC on the hosts' bridge (its front one is veth_name(0))."""
        return f"ol{self.name}-0b"

    @property
    def inventory_path(self) -> Path:
        return self.state_dir / "inventory.yaml"

    @property
    def slurm_inventory_path(self) -> Path:
        """The inventory of a lab made with --slurm: hosts from a Slurm allocation."""
        return self.state_dir / "slurm-inventory.yaml"

    @property
    def slurm_conf(self) -> str | None:
        """SLURM_CONF for a lab made with --slurm (None otherwise)."""
        return (self.state().get("slurm") or {}).get("conf")

    @property
    def key_path(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts_path(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def ssh_config_path(self) -> Path:
        """An OpenSSH client config naming every host (and the bastion) by its lab name:
        ``ssh -F <this> NAME-h1 hostname`` (through the bastion with --bastion)."""
        return self.state_dir / "ssh_config"

    @property
    def state_path(self) -> Path:
        return self.state_dir / "lab.json"

    @property
    def init_path(self) -> Path:
        return self.state_dir / HOLDER_COMM

    def sshd_log(self, i: int) -> Path:
        """Host i's sshd log (i = 0: the bastion's)."""
        return self.host_dir(i) / "sshd.log"

    @property
    def bastion_sshd_log(self) -> Path:
        """The bastion's sshd log (LogLevel VERBOSE: one "Accepted publickey" line per connection)."""
        return self.sshd_log(labnet.BASTION_INDEX)

    # ---- state

    def exists(self) -> bool:
        return self.state_path.is_file()

    def state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            raise LabError(
                f"no lab named {self.name!r} (no {self.state_path})",
                hint=f"start one with: orch lab up N --name {self.name}",
            ) from None
        except (OSError, ValueError) as exc:
            raise LabError(f"cannot read {self.state_path}: {exc}", hint=f"orch lab down --name {self.name}") from None

    def _save_state(self, state: dict) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, self.state_path)

    @property
    def hosts(self) -> list[LabHost]:
        return [self._host_from(h) for h in self.state()["hosts"]]

    @property
    def subnet(self) -> str:
        """The subnet of this machine's bridge (the hosts', unless they are behind a bastion)."""
        return self.state()["subnet"]

    @property
    def hosts_subnet(self) -> str:
        """The subnet the hosts are on (behind the bastion with --bastion)."""
        st = self.state()
        return st.get("hosts_subnet") or st["subnet"]

    @property
    def ssh_port(self) -> int:
        return int(self.state().get("ssh_port") or SSH_PORT)

    @property
    def user(self) -> str:
        """The inventory's user (root unless the lab was made with --user)."""
        return self.state().get("user") or "root"

    @property
    def bastion(self) -> LabHost | None:
        """The bastion (host 0; its address is on this machine's bridge), or None."""
        rec = self.state().get("bastion")
        return self._host_from(rec) if rec else None

    def host(self, i: int) -> LabHost:
        """Host i (1..N); 0 is the bastion of a lab made with --bastion."""
        return self._host_from(self._record(self.state(), i))

    @staticmethod
    def _host_from(rec: dict) -> LabHost:
        return LabHost(rec["index"], rec["name"], rec["address"], rec["netns"], rec["veth"])

    def _record(self, state: dict, i: int) -> dict:
        """Host i's record in `state` (mutable; i = 0: the bastion's)."""
        hosts = state["hosts"]
        if isinstance(i, int) and not isinstance(i, bool):
            if 1 <= i <= len(hosts):
                return hosts[i - 1]
            if i == labnet.BASTION_INDEX and state.get("bastion"):
                return state["bastion"]
        hint = f"hosts are 1..{len(hosts)}" + (" (0: the bastion)" if state.get("bastion") else "")
        raise LabError(f"lab {self.name!r} has no host {i!r}", hint=hint)

    @staticmethod
    def _all_records(state: dict) -> list[dict]:
        """Every host's record, the bastion's (if any) last."""
        return list(state["hosts"]) + ([state["bastion"]] if state.get("bastion") else [])

    def _host_record(self, i: int) -> dict:
        return self._record(self.state(), i)

    # ---- up

    def up(self, n: int, vary: Iterable[str] | Mapping | None = None, refuse_key: Iterable[int] = (),
           slurm: bool = False, *, ssh_port: int = SSH_PORT, user: str = "root", bastion: bool = False) -> "Lab":
        """Replace any lab of this name with n fresh hosts (with a Slurm across them if `slurm`);
        returns self. `ssh_port`: every sshd listens there; `user`: the inventory's user, an
        ordinary account (uid 4300) on every host; `bastion`: the hosts are reachable only
        through a bastion host (see orchestrator/labnet.py)."""
        ssh_port = labnet.validate_port(ssh_port)
        user = labnet.validate_user(user)
        if slurm and bastion:
            raise LabError("a lab cannot have both --slurm and --bastion",
                           hint="Slurm's controller runs on this machine and must reach every slurmd; "
                                "drop one of the two")
        tools = preflight(_UP_TOOLS + (tuple(labslurm.TOOLS) if slurm else ()))
        if not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise LabError(f"a lab has 1..{MAX_HOSTS} hosts, not {n!r}")
        plan_vary = parse_vary(vary)
        for idx in plan_vary:
            if idx != "*" and not 1 <= idx <= n:
                raise LabError(f"--vary names host {idx}, but the lab has hosts 1..{n}")
        refuse = set()
        for idx in refuse_key or ():
            if not isinstance(idx, int) or not 1 <= idx <= n:
                raise LabError(f"--refuse-key names host {idx!r}, but the lab has hosts 1..{n}")
            refuse.add(idx)
        self._check_root_path(user != "root")
        passwd = group = None
        if user != "root":
            # per-host copies of the machine's files (only read here), bound over /etc/passwd and /etc/group
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            passwd = labnet.passwd_with_user(Path("/etc/passwd").read_text(), user, f"/home/{user}", shell)
            group = labnet.group_with_user(Path("/etc/group").read_text(), user)

        self.down()
        with _locked(self.root):
            k = self._pick_subnet()
            m = self._pick_subnet(also_used={k}, salt="b") if bastion else k
            self.state_dir.mkdir(mode=0o755)
            created = self._claim_mountpoints(("/home",) if user != "root" else ())
            hosts = [
                LabHost(i, self.host_name(i), f"{SUBNET_PREFIX}.{m}.{HOST_PREFIX + i}",
                        self.netns_name(i), self.veth_name(i))
                for i in range(1, n + 1)
            ]
            state = {
                "version": STATE_VERSION,
                "name": self.name,
                "status": "starting",
                "k": k,
                "subnet": f"{SUBNET_PREFIX}.{k}.0/24",
                "gateway": f"{SUBNET_PREFIX}.{k}.1",
                "bridge": self.bridge,
                "hosts_subnet": f"{SUBNET_PREFIX}.{m}.0/24",
                "ssh_port": ssh_port,
                "user": user,
                "bastion": None,
                "created_at": time.time(),
                "python": sys.executable,
                "mountpoints_created": created,
                "hosts": [
                    dict(index=h.index, name=h.name, address=h.address, netns=h.netns, veth=h.veth,
                         holder_pid=None, sshd_pid=None, versions=host_versions(plan_vary, h.index),
                         refuse_key=h.index in refuse)
                    for h in hosts
                ],
            }
            if bastion:
                b = labnet.BASTION_INDEX
                state["bastion"] = dict(
                    index=b, name=self.bastion_name(), address=f"{SUBNET_PREFIX}.{k}.{HOST_PREFIX + b}",
                    netns=self.netns_name(b), veth=self.veth_name(b), holder_pid=None, sshd_pid=None,
                    versions={}, refuse_key=False,
                    # its NIC on the hosts' network, which is the lab's second, reserved subnet
                    back_address=f"{SUBNET_PREFIX}.{m}.{HOST_PREFIX + b}", back_veth=self.back_veth_name(),
                    k=m, subnet=f"{SUBNET_PREFIX}.{m}.0/24", bridge=self.hosts_bridge_name,
                )
            self._save_state(state)
        try:
            if passwd is not None:
                _write(self.state_dir / "passwd", passwd)
                _write(self.state_dir / "group", group)
            self._build(state, hosts, plan_vary, refuse, tools)
            if slurm:
                state["slurm"] = labslurm.start(self.state_dir, self.name, k, state["gateway"], hosts, _run,
                                                lambda i: self._enter(self._holder(i)), _nsenter_run, _which)
                text = labslurm.inventory_yaml(self.name, n, Path(state["slurm"]["conf"]), self.key_path,
                                               self.known_hosts_path, SLOTS)
                if user != "root" or ssh_port != SSH_PORT:
                    head = "defaults: {user: root,"
                    if head not in text:
                        raise LabError("cannot put --user/--ssh-port into the Slurm inventory (its format changed)")
                    text = text.replace(head, f"defaults: {{user: {labnet.yaml_str(user)}, port: {ssh_port},", 1)
                _write(self.slurm_inventory_path, text)
                self._save_state(state)
        except BaseException as exc:
            if os.environ.get("ORCH_LAB_KEEP_FAILED"):
                raise
            with contextlib.suppress(Exception):
                self.down()
            if isinstance(exc, LabError):
                raise LabError(exc.message, hint="the partial lab was removed; set ORCH_LAB_KEEP_FAILED=1 to keep "
                                                 f"{self.state_dir} (logs, configs) for a look") from None
            raise
        return self

    def _check_root_path(self, home: bool = False) -> None:
        for bad in ("/tmp", "/root", "/data", "/opt/orch-lab", "/run", "/etc", "/proc", "/sys", "/dev") \
                + (("/home",) if home else ()):
            if self.root == Path(bad) or Path(bad) in self.root.parents:
                raise LabError(
                    f"ORCH_LAB_ROOT={self.root} is under {bad}, which lab hosts mount over",
                    hint=f"use a directory elsewhere, e.g. the default {DEFAULT_ROOT}",
                )

    def _pick_subnet(self, also_used: Iterable[int] = (), salt: str = "") -> int:
        """A free third octet: no other lab's (its own subnet or its bastion's hosts' subnet), no
        address or route of this machine in 198.18.K.0/24."""
        used: set[int] = set(also_used)
        for other in self.root.iterdir():
            if other.name == self.name:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                st = json.loads((other / "lab.json").read_text())
                used.add(int(st["k"]))
                if st.get("bastion"):
                    used.add(int(st["bastion"]["k"]))
        res = _run(["ip", "-o", "-4", "addr", "show"], check=False, timeout=10)
        for m in re.finditer(r"inet\s+198\.18\.(\d+)\.\d+", res.stdout):
            used.add(int(m.group(1)))
        res = _run(["ip", "-o", "-4", "route", "show", "table", "all"], check=False, timeout=10)
        for m in re.finditer(r"(?:^|\s)198\.18\.(\d+)\.\d+", res.stdout):
            used.add(int(m.group(1)))
        start = subnet_octet(self.name + salt)
        for step in range(250):
            k = (start - 1 + step) % 250 + 1
            if k not in used:
                return k
        raise LabError("every 198.18.K.0/24 subnet is taken by other labs", hint="orch lab down --name OTHER")

    def _claim_mountpoints(self, extra_dirs: Sequence[str] = ()) -> list[str]:
        """Create missing mountpoints on the real fs; record them in the shared registry."""
        reg_path = self.root / REGISTRY
        try:
            reg = json.loads(reg_path.read_text())
        except (OSError, ValueError):
            reg = {"created_dirs": [], "created_files": [], "mounts": []}
        created = []
        for d in _MOUNTPOINT_DIRS + tuple(extra_dirs):
            if not os.path.lexists(d):
                os.makedirs(d, mode=0o755)
                reg["created_dirs"].append(d)
                created.append(d)
        for f in _MOUNTPOINT_FILES:
            if not os.path.lexists(f):
                Path(f).touch(mode=0o644)
                reg["created_files"].append(f)
                created.append(f)
        if not _is_mountpoint(_NETNS_DIR):
            # What `ip netns add` does the first time; done here so `down` can undo it.
            if not os.path.lexists(_NETNS_DIR):
                os.makedirs(_NETNS_DIR, mode=0o755)
                reg["created_dirs"].insert(0, _NETNS_DIR)
                created.append(_NETNS_DIR)
            _run(["mount", "--bind", _NETNS_DIR, _NETNS_DIR], what="mount --bind /run/netns")
            _run(["mount", "--make-shared", _NETNS_DIR], what="mount --make-shared /run/netns")
            reg["mounts"].append(_NETNS_DIR)
            created.append(f"mount:{_NETNS_DIR}")
        tmp = reg_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(reg, indent=1) + "\n")
        os.replace(tmp, reg_path)
        return created

    def _build(self, state: dict, hosts: list[LabHost], vary: dict, refuse: set[int], tools: dict) -> None:
        sd = self.state_dir
        port, user, brec = state["ssh_port"], state["user"], state.get("bastion")
        plans = [_HostPlan(h, self.host_dir(h.index), host_versions(vary, h.index), h.index in refuse) for h in hosts]
        bplan = _HostPlan(self._host_from(brec), self.host_dir(brec["index"]),
                          back_address=brec["back_address"]) if brec else None
        every = plans + ([bplan] if bplan else [])  # the order of _all_records(state)
        for p in every:
            p.dir.mkdir()

        # keys: the lab's user key + one host key per host, in parallel
        keygen = tools["ssh-keygen"]
        jobs = [[keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"orch-lab-{self.name}", "-f", str(self.key_path)]]
        jobs += [[keygen, "-q", "-t", "ed25519", "-N", "", "-C", p.host.name, "-f", str(p.dir / "ssh_host_ed25519_key")]
                 for p in every]
        _parallel(lambda argv: _run(argv, what="ssh-keygen", timeout=30), jobs)
        user_pub = (sd / "id_ed25519.pub").read_text().strip()
        user_key = self.key_path.read_text()
        entries = []
        for p in every:
            pub = (p.dir / "ssh_host_ed25519_key.pub").read_text().split(" ")
            names = [p.host.address] + ([p.back_address] if p.back_address else []) + [p.host.name]
            entries.append((names, f"{pub[0]} {pub[1]}"))
        _write(self.known_hosts_path, labnet.known_hosts_text(entries, port))
        known = labnet.known_hosts_text(entries, port, both=True)  # a host's own: `ssh -p P` and plain names

        # per-host files
        try:
            base_hosts = Path("/etc/hosts").read_text()
        except OSError:
            base_hosts = "127.0.0.1 localhost\n"
        hosts_text = base_hosts.rstrip("\n") + f"\n# orch lab {self.name}\n" + "".join(
            f"{h.address} {h.name}\n" for h in hosts)
        if bplan:
            hosts_text += f"{bplan.back_address} {bplan.host.name}\n"
        try:
            base_bashrc = Path("/root/.bashrc").read_text()
        except OSError:
            base_bashrc = ""
        bashrc = ("# orch lab: non-interactive shells (ssh HOST CMD) keep PATH from ~/.ssh/environment\n"
                  "case $- in *i*) ;; *) return ;; esac\n" + base_bashrc)
        pydir = os.path.dirname(sys.executable)
        need_openmpi_version = any(v.get("openmpi", "none") != "none" for v in (p.versions for p in plans))
        real_ompi = _openmpi_real_version(tools["mpirun"]) if need_openmpi_version else ""
        pathdirs = host_path_env(pydir, False, False).split("=", 1)[1].strip().split(":")
        hide_exes = _openmpi_names(pathdirs) if any(p.versions.get("openmpi") == "none" for p in plans) else {}

        if re.search(r"\s", sys.executable) or len(sys.executable) > 200:
            raise LabError(f"the lab's init runs with this python, but {sys.executable!r} cannot be a #! interpreter",
                           hint="run orch from a python whose path has no spaces")
        _write(self.init_path, init_script(sys.executable), 0o755)
        for p in every:
            self._write_host(p, user_pub, user_key, known, hosts_text, bashrc, pydir, real_ompi, hide_exes, tools,
                             port=port, user=user)

        # network: bridge(s), namespaces, veths in one `ip -batch`
        k = state["k"]
        lines = [
            f"link add name {self.bridge} type bridge forward_delay 0",
            f"addr add {SUBNET_PREFIX}.{k}.1/24 dev {self.bridge}",
            f"link set {self.bridge} up",
        ]
        hosts_bridge = self.bridge
        # behind a bastion: no IPv6 link-local either on this machine's side of the hosts' network
        v6 = brec is not None and os.path.isdir("/proc/sys/net/ipv6")
        no_v6 = (lambda dev: [f"link set {dev} addrgenmode none"] if v6 else [])
        if brec:
            hosts_bridge = brec["bridge"]
            b = bplan.host
            lines += [f"link add name {hosts_bridge} type bridge forward_delay 0", *no_v6(hosts_bridge),
                      f"link set {hosts_bridge} up",
                      # no way from here to the hosts: a connect fails at once, nothing leaves the machine
                      f"route add unreachable {brec['subnet']}",
                      f"netns add {b.netns}",
                      f"link add {b.veth} type veth peer name eth0 netns {b.netns}",
                      f"link set {b.veth} master {self.bridge} up",
                      f"link add {brec['back_veth']} type veth peer name eth1 netns {b.netns}",
                      *no_v6(brec["back_veth"]),
                      f"link set {brec['back_veth']} master {hosts_bridge} up"]
        for h in hosts:
            lines += [
                f"netns add {h.netns}",
                f"link add {h.veth} type veth peer name eth0 netns {h.netns}",
                *no_v6(h.veth),
                f"link set {h.veth} master {hosts_bridge} up",
            ]
        res = _run(["ip", "-batch", "-"], input="\n".join(lines) + "\n", check=False, timeout=120)
        if res.returncode != 0:
            raise LabError(
                f"could not create the lab network: {res.stderr.strip() or res.stdout.strip()}",
                hint="the lab needs network namespaces, veth and bridge support (CAP_NET_ADMIN, a kernel with "
                     "CONFIG_NET_NS/CONFIG_VETH/CONFIG_BRIDGE)",
            )

        # holders: per host, one `ip netns exec .. unshare .. --pid sh -c 'sh setup.sh &'`, in parallel.
        # unshare --pid without --fork: the outer sh stays in this PID namespace (so its $! is
        # the holder's pid as seen from here) and its first child, setup.sh, is PID 1 of the new
        # one; setup.sh prints "ready" and execs the init, which closes the pipe once it runs.
        unshare = tools["unshare"]

        def start_holder(p: _HostPlan) -> int:
            # nsenter --net, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup (which
            # slurmd needs); setup.sh mounts the namespace's own sysfs and keeps the cgroup tree.
            res = _run(["nsenter", f"--net={_NETNS_DIR}/{p.host.netns}", unshare, "--uts", "--mount",
                        "--propagation", "private",
                        "--pid", "/bin/sh", "-c", '/bin/sh "$1" & echo "$!"', "sh", str(p.dir / "setup.sh")],
                       check=False, timeout=60, start_new_session=True)
            out = res.stdout.split()
            pids = [int(x) for x in out if x.isdigit()]
            if res.returncode != 0 or "ready" not in out or len(pids) != 1 or not _pid_alive(pids[0], HOLDER_COMM):
                raise LabError(
                    f"{p.host.name}: setting up the host failed (exit {res.returncode}): "
                    f"{(res.stderr or res.stdout).strip()[-500:] or 'the init did not start'}",
                    hint=f"see {p.dir / 'setup.sh'}",
                )
            return pids[0]

        holders = _parallel(start_holder, every, workers=8)
        for rec, pid in zip(self._all_records(state), holders):
            rec["holder_pid"] = pid
        self._save_state(state)

        # sshd per host (and the bastion), inside the holder's namespaces
        _parallel(lambda p: self._start_sshd(p.host, wait=False), every, workers=8)
        deadline = time.monotonic() + 20
        for rec, p in zip(self._all_records(state), every):
            rec["sshd_pid"] = self._wait_sshd_pid(p.host, deadline)
        self._await_reachable([p.host for p in every], deadline)

        jump = f"{user}@{bplan.host.address}:{port}" if bplan else None
        _write(self.inventory_path, inventory_yaml(self.name, state["hosts_subnet"], hosts, self.key_path,
                                                   self.known_hosts_path, user=user, port=port, jump=jump))
        _write(self.ssh_config_path, labnet.ssh_client_config(
            self.name, hosts, bplan.host if bplan else None, user=user, port=port, key=self.key_path,
            known_hosts=self.known_hosts_path, state_dir=self.state_dir))
        state["status"] = "up"
        self._save_state(state)

    def _write_host(self, p: _HostPlan, user_pub: str, user_key: str, known: str, hosts_text: str, bashrc: str,
                    pydir: str, real_ompi: str, hide_exes: dict[str, list[str]], tools: dict, *,
                    port: int = SSH_PORT, user: str = "root") -> None:
        d, h = p.dir, p.host
        (d / "data").mkdir()
        tmp = d / "tmp"
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        (d / "rootov").mkdir()
        (d / "cgroup").mkdir()
        _write(d / "hccn.conf", hccn_conf(h.index))
        _write(d / "hosts", hosts_text)
        _write(d / "bashrc", bashrc)

        ssh = d / "ssh"
        ssh.mkdir(mode=0o700)
        if p.refuse_key:
            _write(ssh / "authorized_keys", "# orch lab --refuse-key: the lab key is not accepted here\n", 0o600)
        else:
            _write(ssh / "authorized_keys", user_pub + "\n", 0o600)
        _write(ssh / "id_ed25519", user_key, 0o600)
        _write(ssh / "id_ed25519.pub", user_pub + "\n", 0o644)
        _write(ssh / "known_hosts", known, 0o644)
        _write(ssh / "config", labnet.HOST_SSH_CONFIG, 0o600)

        opt = d / "opt"
        for sub in ("bin", "site", "lib"):
            (opt / sub).mkdir(parents=True)
        hide_dists: list[Path] = []
        for tool, version in sorted(p.versions.items()):
            if tool == "openmpi":
                if version != "none":
                    mpirun = tools["mpirun"]
                    _write(opt / "bin" / "mpirun", mpirun_shim(mpirun, real_ompi, version), 0o755)
                    _write(opt / "bin" / "mpiexec", mpirun_shim(mpirun, real_ompi, version), 0o755)
                    info = _which("ompi_info") or "/usr/bin/ompi_info"
                    _write(opt / "bin" / "ompi_info", ompi_info_shim(info, real_ompi, version), 0o755)
            elif tool == "python":
                _write(opt / "bin" / "python3", python_shim(version, sys.executable), 0o755)
                os.symlink("python3", opt / "bin" / "python")
            elif tool == "nccl":
                if version != "none":
                    lib = opt / "lib" / f"libnccl.so.{version}"
                    _write(lib, "")
                    os.symlink(lib.name, opt / "lib" / f"libnccl.so.{version.split('.')[0]}")
            else:
                if version == "none":
                    for dist in _installed_dist_dirs(tool):
                        if Path("/root") not in dist.parents:
                            raise LabError(
                                f"cannot hide {tool} on {h.name}: it is installed at {dist}, outside /root",
                                hint=f"drop --vary {h.index}:{tool}=none or uninstall {tool}",
                            )
                        hide_dists.append(dist)
                else:
                    norm = re.sub(r"[-_.]+", "_", tool)
                    info = opt / "site" / f"{norm}-{version}.dist-info"
                    info.mkdir()
                    _write(info / "METADATA", dist_metadata(tool, version))
                    _write(info / "INSTALLER", "orch-lab\n")
        has_site = any((opt / "site").iterdir())
        has_lib = any((opt / "lib").iterdir())
        _write(ssh / "environment", host_path_env(pydir, has_site, has_lib), 0o600)
        if p.back_address:
            _write(d / "sshd_config", sshd_config(h, d, port, labnet.BASTION_MAX_STARTUPS))
        else:
            _write(d / "sshd_config", sshd_config(h, d, port))

        home = d / "home"
        if user != "root":
            # the user's home (bound at /home/USER) with a ~/.ssh like root's; /data is theirs
            home.mkdir(mode=0o755)
            shutil.copytree(ssh, home / ".ssh")
            for path in [home, *home.rglob("*"), d / "data"]:
                os.chown(path, labnet.USER_ID, labnet.USER_ID)

        q = shlex.quote
        script = [
            "set -e",
            f"# orch lab: set up host {h.name} inside its fresh net+uts+mount+pid namespaces (this is PID 1)",
            "mount -t proc -o nosuid,nodev,noexec proc /proc",
            "ip link set lo up",
            f"ip addr add {h.address}/24 dev eth0",
            "ip link set eth0 up",
        ]
        if p.back_address:
            # the bastion: a second NIC on the hosts' network, and no forwarding between the two
            # (a new network namespace may inherit ip_forward=1 from this machine's)
            script += [
                f"ip addr add {p.back_address}/24 dev eth1",
                "ip link set eth1 up",
                "echo 0 > /proc/sys/net/ipv4/ip_forward",
            ]
        script += [
            f"echo {q(h.name)} > /proc/sys/kernel/hostname",
            "mount --make-rprivate /",
            # this network namespace's own sysfs (/sys/class/net shows eth0), with the machine's cgroups
            f"mount --rbind /sys/fs/cgroup {q(str(d / 'cgroup'))}",
            "mount -t sysfs orch-lab-sys /sys",
            f"mount --move {q(str(d / 'cgroup'))} /sys/fs/cgroup",
            f"mount --bind {q(str(d / 'data'))} /data",
            f"mount --bind {q(str(d / 'hccn.conf'))} /etc/hccn.conf",
            f"mount --bind {q(str(d / 'hosts'))} /etc/hosts",
            f"mount --bind {q(str(opt))} /opt/orch-lab",
            f"mount -t tmpfs -o mode=0755 orch-lab-root {q(str(d / 'rootov'))}",
            f"mkdir {q(str(d / 'rootov' / 'upper'))} {q(str(d / 'rootov' / 'work'))}",
            "mount -t overlay orch-lab-root -o "
            + q(f"lowerdir=/root,upperdir={d / 'rootov' / 'upper'},workdir={d / 'rootov' / 'work'}") + " /root",
            "rm -rf /root/.ssh && mkdir -m 700 /root/.ssh",
            f"mount --bind {q(str(ssh))} /root/.ssh",
            f"cat {q(str(d / 'bashrc'))} > /root/.bashrc",
        ]
        if user != "root":
            rootov = d / "rootov"
            script += [
                f"mount --bind {q(str(self.state_dir / 'passwd'))} /etc/passwd",
                f"mount --bind {q(str(self.state_dir / 'group'))} /etc/group",
                # /home: an overlay like /root (the real homes stay visible, writes stay on the host)
                f"mkdir {q(str(rootov / 'homeup'))} {q(str(rootov / 'homework'))}",
                "mount -t overlay orch-lab-home -o "
                + q(f"lowerdir=/home,upperdir={rootov / 'homeup'},workdir={rootov / 'homework'}") + " /home",
                f"mkdir -p {q('/home/' + user)}",
                f"mount --bind {q(str(home))} {q('/home/' + user)}",
                # the user may run this machine's python (under /root, say pyenv's); /root's own
                # mode changes only in this host's overlay
                "chmod 711 /root",
            ]
        if p.versions.get("openmpi") == "none":
            for n, (dirpath, names) in enumerate(sorted(hide_exes.items())):
                if not dirpath.startswith("/root/"):  # /root is an overlay already
                    up, work = d / "rootov" / f"hide{n}", d / "rootov" / f"hide{n}.work"
                    script += [f"mkdir {q(str(up))} {q(str(work))}",
                               "mount -t overlay orch-lab-hide -o "
                               + q(f"lowerdir={dirpath},upperdir={up},workdir={work}") + f" {q(dirpath)}"]
                script.append("rm -f " + " ".join(q(f"{dirpath}/{x}") for x in names))
        script += [f"rm -rf {q(str(dist))}" for dist in hide_dists]
        script += [
            f"mount --bind {q(str(tmp))} /tmp",
            "cd /",
            "echo ready",
            f"exec {q(str(self.init_path))} </dev/null",
        ]
        _write(d / "setup.sh", "\n".join(script) + "\n", 0o755)

    # ---- sshd

    def _holder(self, i: int) -> int:
        rec = self._host_record(i)
        pid = rec.get("holder_pid")
        ns = _ns_inode(f"{_NETNS_DIR}/{rec['netns']}")
        if not _holder_alive(pid) or ns is None or _ns_inode(f"/proc/{pid}/ns/net") != ns:
            raise LabError(
                f"{rec['name']}: the lab host is gone (its namespace holder, pid {pid}, is not running)",
                hint=f"recreate the lab: orch lab up N --name {self.name}",
            )
        return pid

    @staticmethod
    def _enter(holder: int) -> list[str]:
        """nsenter argv prefix into a host's net+uts+mount+pid namespaces (nsenter forks for -p)."""
        return ["nsenter", "-t", str(holder), "-n", "-u", "-m", "-p"]

    def _start_sshd(self, h: LabHost, wait: bool = True) -> int | None:
        d = self.host_dir(h.index)
        holder = self._holder(h.index)
        with contextlib.suppress(FileNotFoundError):
            (d / "sshd.pid").unlink()
        sshd = _which("sshd") or "/usr/sbin/sshd"
        # sshd daemonises at once: its daemon is reparented to the host's init, the short-lived
        # first sshd (nsenter's child, in the host's PID namespace) is reaped by nsenter.
        res = _nsenter_run([*self._enter(holder), sshd, "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")],
                           timeout=30, what=f"{h.name}: starting sshd")
        if res.returncode != 0:
            raise LabError(
                f"{h.name}: sshd did not start (exit {res.returncode}): {self._log_tail(h.index)}",
                hint=f"see {d / 'sshd.log'} and {d / 'sshd_config'}",
            )
        if wait:
            return self._wait_sshd(h, time.monotonic() + 15, holder)
        return None

    def _sshd_pid(self, i: int, holder: int | None = None) -> int | None:
        """Root-namespace pid of host i's running sshd (its PidFile holds the host-local one)."""
        nspid = _read_pid(self.host_dir(i) / "sshd.pid")
        if not nspid:
            return None
        if holder is None:
            holder = self._host_record(i).get("holder_pid")
        if not _holder_alive(holder):
            return None
        pid = _root_pid(holder, nspid)
        return pid if _pid_alive(pid, "sshd") else None

    def root_pid(self, i: int, pid: int) -> int | None:
        """The pid, as this machine's root PID namespace sees it, of the process that is `pid` on host i
        (what ``echo $!`` printed over ssh); None if there is no such process."""
        found = _root_pid(self._holder(i), int(pid))
        return found if _pid_alive(found) else None

    def _wait_sshd(self, h: LabHost, deadline: float, holder: int | None = None) -> int:
        pid = self._wait_sshd_pid(h, deadline, holder)
        self._await_reachable([h], deadline)
        return pid

    def _wait_sshd_pid(self, h: LabHost, deadline: float, holder: int | None = None) -> int:
        if holder is None:
            holder = self._holder(h.index)
        while True:
            pid = self._sshd_pid(h.index, holder)
            if pid:
                return pid
            if time.monotonic() > deadline:
                raise LabError(f"{h.name}: sshd did not come up: {self._log_tail(h.index)}",
                               hint=f"see {self.sshd_log(h.index)}")
            time.sleep(0.01)

    def _await_reachable(self, hosts: Sequence[LabHost], deadline: float) -> None:
        """Until every host's sshd port accepts a connection. The pid file is written after listen();
        one connect proves the path through the bridge: from here, or for hosts behind a bastion
        from the bastion's network namespace (one probe process for all of them)."""
        state = self.state()
        port = int(state.get("ssh_port") or SSH_PORT)
        brec = state.get("bastion")
        behind = [h for h in hosts if brec and h.index != brec["index"]]
        for h in hosts:
            if h in behind:
                continue
            while True:
                try:
                    with socket.create_connection((h.address, port), timeout=2):
                        break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise LabError(f"{h.name}: sshd runs but {h.address}:{port} is unreachable: {exc}",
                                       hint=f"check the link: orch lab status --name {self.name}") from None
                    time.sleep(0.02)
        if behind:
            left = max(deadline - time.monotonic(), 0.5)
            res = _run(["nsenter", f"--net={_NETNS_DIR}/{brec['netns']}", sys.executable, "-I", "-S", "-c",
                        labnet.REACH_PROBE, f"{left:.2f}", *(f"{h.address}:{port}" for h in behind)],
                       check=False, timeout=left + 20, what="reaching the hosts from the bastion")
            if res.returncode != 0:
                raise LabError(f"sshd runs but the bastion {brec['name']} cannot reach: "
                               f"{(res.stdout or res.stderr).strip()[-500:]}",
                               hint=f"check the links: orch lab status --name {self.name}")

    def _log_tail(self, i: int, lines: int = 3) -> str:
        try:
            tail = self.sshd_log(i).read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return "(no sshd log)"
        return " / ".join(tail) or "(empty sshd log)"

    def sshd(self, i: int, on: bool) -> None:
        """Stop (the host refuses connections; open sessions live on) or start host i's sshd."""
        preflight(("nsenter",))
        h = self.host(i)
        pidfile = self.host_dir(i) / "sshd.pid"
        state = self.state()
        rec = self._record(state, i)
        pid = self._sshd_pid(i)
        if on:
            if pid:
                return
            new = self._start_sshd(h)
            rec["sshd_pid"] = new
        else:
            if pid:
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 5
                while _pid_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                if _pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(FileNotFoundError):
                pidfile.unlink()
            rec["sshd_pid"] = None
        self._save_state(state)

    # ---- link

    def link(self, i: int, up: bool) -> None:
        """Take host i's link down (it vanishes from the network) or bring it back. The bastion's
        (i = 0) is its NIC on this machine's bridge: down, no host can be reached from here."""
        preflight(("ip",))
        h = self.host(i)
        _run(["ip", "link", "set", h.veth, "up" if up else "down"], what=f"{h.name}: ip link set {h.veth}")

    @staticmethod
    def _link_up(veth: str) -> bool:
        try:
            return int(Path(f"/sys/class/net/{veth}/flags").read_text(), 16) & 0x1 == 1
        except (OSError, ValueError):
            return False

    # ---- exec / ssh

    def exec(self, i: int, argv: Sequence[str], *, input: str | None = None, timeout: float = 60,
             check: bool = False, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv on host i (0: the bastion): inside its net+uts+mount+pid namespaces (as root, cwd /).

        Text output. ``ps``/``/proc`` show the host's processes; pids are host-local.
        """
        holder = self._holder(i)
        res = _nsenter_run([*self._enter(holder), "--", *argv], input=input, timeout=timeout,
                           env=dict(env) if env is not None else None,
                           what=f"{self.host_name(i)}: {shlex.join(argv)}")
        if check and res.returncode != 0:
            raise LabError(f"{self.host_name(i)}: {shlex.join(argv)} failed (exit {res.returncode}): "
                           f"{res.stderr.strip()[-300:]}")
        return res

    def ssh_argv(self, i: int, command: str | None = None, *, connect_timeout: int = 5,
                 user: str | None = None) -> list[str]:
        """The system ssh client's argv to reach host i (0: the bastion) as `user` (default root)
        with the lab's key and port (reads nothing in ~/.ssh); through the bastion, as the same
        user, when the lab has one."""
        state = self.state()
        h = self._host_from(self._record(state, i))
        user = user or "root"
        opts = [
            "-i", str(self.key_path),
            "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts_path}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", f"ConnectTimeout={connect_timeout}",
            "-o", "LogLevel=ERROR", "-p", str(state.get("ssh_port") or SSH_PORT),
        ]
        argv = ["ssh", "-F", "/dev/null", *opts]
        brec = state.get("bastion")
        if brec and i != brec["index"]:
            jump = ["ssh", "-F", "/dev/null", *opts, "-W", "[%h]:%p", f"{user}@{brec['address']}"]
            argv += ["-o", "ProxyCommand=" + shlex.join(jump)]
        argv.append(f"{user}@{h.address}")
        if command is not None:
            argv.append(command)
        return argv

    def ssh(self, i: int, command: str, *, timeout: float = 30, connect_timeout: int = 5,
            input: str | None = None, user: str | None = None) -> subprocess.CompletedProcess:
        """Run a shell command on host i over real SSH (as `user`, default root); never raises for
        a non-zero exit."""
        try:
            return subprocess.run(self.ssh_argv(i, command, connect_timeout=connect_timeout, user=user),
                                  input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 255, exc.stdout or "", f"timed out after {timeout:g}s")

    # ---- status

    def status(self) -> list[HostStatus]:
        """One per host, 1..N; then the bastion's (host.index 0), if the lab has one."""
        preflight(("ip",))
        out = []
        for rec in self._all_records(self.state()):
            h = self._host_from(rec)
            pid = self._sshd_pid(h.index, rec.get("holder_pid"))
            out.append(HostStatus(
                host=h,
                netns=os.path.exists(f"{_NETNS_DIR}/{h.netns}"),
                holder_pid=rec.get("holder_pid"),
                holder_alive=_holder_alive(rec.get("holder_pid")),
                sshd_pid=pid,
                sshd_alive=pid is not None,
                link_up=self._link_up(h.veth),
            ))
        return out

    # ---- down

    def _lab_pids(self, holders: Iterable[tuple[int, int]]) -> set[int]:
        """Every live process in one of the lab's namespaces, or an sshd of its config."""
        pat = re.compile(rf"olab-{re.escape(self.name)}-\d+")
        net_inodes = set()
        with contextlib.suppress(OSError):
            for entry in os.listdir(_NETNS_DIR):
                if pat.fullmatch(entry):
                    ino = _ns_inode(f"{_NETNS_DIR}/{entry}")
                    if ino:
                        net_inodes.add(ino)
        # A holder whose netns name is already gone (an interrupted down) still counts.
        # Its PID namespace counts too, unless it is ours (a holder of an older lab has none).
        mnt_inodes = set()
        pid_inodes = set()
        my_mnt = _ns_inode("/proc/self/ns/mnt")
        my_pidns = _ns_inode("/proc/self/ns/pid")
        for i, pid in holders:
            if not _holder_alive(pid):
                continue
            mnt = _ns_inode(f"/proc/{pid}/ns/mnt")
            net = _ns_inode(f"/proc/{pid}/ns/net")
            pidns = _ns_inode(f"/proc/{pid}/ns/pid")
            if not mnt or not net or mnt == my_mnt:
                continue
            if net in net_inodes or _same_file(f"/proc/{pid}/root/data", self.host_dir(i) / "data"):
                mnt_inodes.add(mnt)
                net_inodes.add(net)
                if pidns and pidns != my_pidns:
                    pid_inodes.add(pidns)
        marker = (str(self.state_dir) + "/").encode()
        init = str(self.init_path).encode()
        me = os.getpid()
        found = set()
        for pid in _proc_pids():
            if pid == me:
                continue
            if (_ns_inode(f"/proc/{pid}/ns/net") in net_inodes or _ns_inode(f"/proc/{pid}/ns/mnt") in mnt_inodes
                    or _ns_inode(f"/proc/{pid}/ns/pid") in pid_inodes):
                found.add(pid)
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            argv = cmdline.split(b"\0")
            if marker in cmdline and (os.path.basename(argv[0]) in (b"sshd", b"sleep", *labslurm.DAEMONS)
                                      or init in argv[1:3]):
                found.add(pid)
        return {p for p in found if _pid_alive(p)}

    def down(self) -> bool:
        """Remove the lab completely; True if there was anything to remove. Idempotent."""
        preflight(_DOWN_TOOLS)
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            state = {}
        recs = state.get("hosts", []) + ([state["bastion"]] if state.get("bastion") else [])
        holders = [(h["index"], h["holder_pid"]) for h in recs if h.get("holder_pid")]
        found = self.state_dir.exists()

        # 1. processes: SIGKILL everything in the lab's namespaces until none is left
        deadline = time.monotonic() + 10
        while True:
            pids = self._lab_pids(holders)
            if not pids:
                break
            found = True
            if time.monotonic() > deadline:
                raise LabError(f"lab {self.name!r}: processes {sorted(pids)} survive SIGKILL",
                               hint="they may be stuck in the kernel (D state); retry orch lab down")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

        # 2. network: veths, bridges, namespaces (the bastion's too: netns -0, veths -0 and -0b,
        # the hosts' bridge, the unreachable route to their subnet)
        vpat = re.compile(rf"ol{re.escape(self.name)}-\d+b?")
        npat = re.compile(rf"olab-{re.escape(self.name)}-\d+")
        links = [x for x in _listdir("/sys/class/net") if vpat.fullmatch(x)]
        nss = [x for x in _listdir(_NETNS_DIR) if npat.fullmatch(x)]
        bridges = [b for b in (self.bridge, self.hosts_bridge_name) if os.path.exists(f"/sys/class/net/{b}")]
        lines = [f"link del {v}" for v in links]
        lines += [f"link del {b}" for b in bridges]
        lines += [f"netns del {ns}" for ns in nss]
        route = None
        with contextlib.suppress(KeyError, TypeError):
            route = state["bastion"]["subnet"]
        if route and _run(["ip", "-4", "route", "show", "type", "unreachable", route], check=False,
                          timeout=10).stdout.strip():
            lines.append(f"route del unreachable {route}")
        if lines:
            found = True
            res = _run(["ip", "-force", "-batch", "-"], input="\n".join(lines) + "\n", check=False, timeout=120)
            left = ([v for v in links + bridges if os.path.exists(f"/sys/class/net/{v}")]
                    + [n for n in nss if os.path.exists(f"{_NETNS_DIR}/{n}")])
            if route and _run(["ip", "-4", "route", "show", "type", "unreachable", route], check=False,
                              timeout=10).stdout.strip():
                left.append(f"route unreachable {route}")
            if left:
                raise LabError(f"lab {self.name!r}: could not remove {', '.join(left)}: {res.stderr.strip()[-300:]}")

        # 3. state dir, then the shared mountpoints once no lab is left
        if self.state_dir.exists():
            shutil.rmtree(self.state_dir)
        if self.root.is_dir():
            with _locked(self.root):
                self._release_mountpoints()
        return found

    def _release_mountpoints(self) -> None:
        others = [p for p in self.root.iterdir() if p.is_dir()]
        if others:
            return
        reg_path = self.root / REGISTRY
        try:
            reg = json.loads(reg_path.read_text())
        except (OSError, ValueError):
            reg = {}
        for path in reg.get("mounts", []):
            while _is_mountpoint(path) and not _listdir(path):
                if _run(["umount", path], check=False, timeout=20).returncode != 0:
                    break
        for path in reg.get("created_files", []):
            with contextlib.suppress(OSError):
                if os.path.isfile(path) and os.path.getsize(path) == 0 and not _is_mountpoint(path):
                    os.unlink(path)
        for path in reversed(reg.get("created_dirs", [])):
            with contextlib.suppress(OSError):
                if not _is_mountpoint(path):
                    os.rmdir(path)  # only if empty
        with contextlib.suppress(FileNotFoundError):
            reg_path.unlink()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def list_labs(root: str | os.PathLike | None = None) -> list[str]:
    """Names of labs on this machine: state dirs, and namespaces/bridges of half-removed ones."""
    root = Path(root or os.environ.get("ORCH_LAB_ROOT") or DEFAULT_ROOT)
    names = {p.name for p in root.iterdir() if p.is_dir() and NAME_RE.fullmatch(p.name)} if root.is_dir() else set()
    for entry in _listdir(_NETNS_DIR):
        m = re.fullmatch(r"olab-([a-z0-9]{1,8})-\d+", entry)
        if m:
            names.add(m.group(1))
    for entry in _listdir("/sys/class/net"):
        m = re.fullmatch(r"ol-b[rh]-([a-z0-9]{1,8})", entry)
        if m:
            names.add(m.group(1))
    return sorted(names)


def _is_mountpoint(path: str) -> bool:
    """True if something is mounted at path (os.path.ismount misses same-fs bind mounts)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                mp = line.split(" ", 5)[4]
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mp)
                if mp == target:
                    return True
    except OSError:
        return os.path.ismount(path)
    return False


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


# --------------------------------------------------------------------------- CLI


@click.group("lab")
def lab_group() -> None:
    """A simulated N-host cluster on this machine (root, Linux): netns + real sshd per host."""


_name_option = click.option("--name", default="lab", show_default=True, help="Lab name: 1-8 of a-z, 0-9.")


@lab_group.command("up")
@click.argument("n", type=int)
@_name_option
@click.option("--vary", multiple=True, metavar="I:TOOL=VERSION",
              help="Host I reports another version (openmpi, python, nccl, mindspore, torch, any python "
                   "dist; VERSION may be 'none'). I may be '*' for every host. Repeatable.")
@click.option("--all", "all_", multiple=True, metavar="TOOL=VERSION", help="Same as --vary '*:TOOL=VERSION'.")
@click.option("--refuse-key", multiple=True, type=int, metavar="I", help="Host I does not accept the lab key.")
@click.option("--slurm", is_flag=True, help="Also run a real Slurm: slurmctld here, a slurmd on every host "
                                            "(Debian's slurm-wlm and munge); prints its inventory too.")
@click.option("--ssh-port", type=click.IntRange(1, 65535), default=SSH_PORT, show_default=True,
              help="Port of every host's sshd (and the bastion's).")
@click.option("--user", default="root", show_default=True,
              help=f"The inventory's user: an ordinary account (uid {labnet.USER_ID}, home /home/USER) on every "
                   "host; root login still works.")
@click.option("--bastion", is_flag=True, help="Put the hosts on a network this machine cannot reach, behind a bastion "
                                              "(host 0, a jump host); writes an ssh_config too.")
@click.option("--replace", is_flag=True, help="Replace a lab of this name that is already up (everything on it stops).")
def lab_up(n: int, name: str, vary: tuple[str, ...], all_: tuple[str, ...], refuse_key: tuple[int, ...],
           slurm: bool, ssh_port: int, user: str, bastion: bool, replace: bool) -> None:
    """Start N hosts; prints the inventory path. A lab of the same name that is up is replaced
    only with --replace (someone may be using it)."""
    lab = Lab(name)
    if lab.exists() and not replace:
        try:
            st = lab.state()
            made = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.get("created_at", 0)))
            what = f"{len(st.get('hosts', []))} hosts, made {made}"
        except LabError:
            what = "its state unreadable"
        raise LabError(f"lab {name} is already up ({what}); someone may be using it",
                       hint=f"pass --replace to remove it and make a new one, or pick another --name "
                            f"(`orch lab down --name {name}` removes it)")
    t0 = time.monotonic()
    lab.up(n, vary=[f"*:{a}" for a in all_] + list(vary), refuse_key=refuse_key, slurm=slurm, ssh_port=ssh_port,
           user=user, bastion=bastion)
    st = lab.state()
    where = (f"{st['hosts_subnet']} behind a bastion on {st['subnet']}" if st.get("bastion") else st["subnet"])
    click.echo(f"lab {name}: {n} hosts on {where} (bridge {st['bridge']}) up in {time.monotonic() - t0:.1f}s")
    if n <= 32:
        for rec in st["hosts"]:
            extra = " ".join(f"{k}={v}" for k, v in sorted(rec["versions"].items()))
            if rec["refuse_key"]:
                extra += " refuse-key"
            click.echo(f"  {rec['name']:<14} {rec['address']:<15} {extra}".rstrip())
    if st.get("bastion"):
        b = st["bastion"]
        click.echo(f"  {b['name']:<14} {b['address']:<15} bastion (host 0), {b['back_address']} on the hosts' side")
    if ssh_port != SSH_PORT or user != "root":
        click.echo(f"ssh: user {user}, port {ssh_port}")
    if st.get("bastion"):
        click.echo(f"ssh_config (every host by name, through the bastion): {lab.ssh_config_path}")
    click.echo(f"use it with any cluster file: orch up FILE -i {lab.inventory_path}", err=True)
    click.echo(str(lab.inventory_path))
    if slurm:
        click.echo(f"Slurm: partition {labslurm.PARTITION}, SLURM_CONF={lab.slurm_conf}; a Slurm inventory:")
        click.echo(str(lab.slurm_inventory_path))


@lab_group.command("down")
@_name_option
@click.option("--all", "all_", is_flag=True, help="Remove every lab on this machine (stale test labs too).")
def lab_down(name: str, all_: bool) -> None:
    """Remove the lab: processes, namespaces, veths, bridge, state dir. Idempotent."""
    names = list_labs() if all_ else [name]
    if not names:
        click.echo("no labs")
    for n in names:
        removed = Lab(n).down()
        click.echo(f"lab {n}: {'removed' if removed else 'nothing to remove'}")


@lab_group.command("inventory")
@_name_option
@click.option("--slurm", is_flag=True, help="the lab's Slurm inventory (a lab made with --slurm)")
def lab_inventory(name: str, slurm: bool) -> None:
    """Print the path of the lab's inventory, for -i: `orch up FILE -i "$(orch lab inventory --name X)"`."""
    lab = Lab(name)
    path = lab.slurm_inventory_path if slurm else lab.inventory_path
    if not lab.exists() or not path.exists():
        raise LabError(f"lab {name} has no {'Slurm ' if slurm else ''}inventory ({path} does not exist)",
                       hint=f"orch lab up N --name {name}" + (" --slurm" if slurm else ""))
    click.echo(str(path))


@lab_group.command("status")
@_name_option
def lab_status(name: str) -> None:
    """Per host: name, address, netns, sshd, link."""
    lab = Lab(name)
    preflight(_DOWN_TOOLS)
    if not lab.exists():
        click.echo(f"lab {name}: not up (no {lab.state_path})")
        return
    st = lab.state()
    click.echo(f"lab {name}: {st['subnet']} bridge {st['bridge']} status {st.get('status')}")
    if st.get("bastion"):
        b = st["bastion"]
        click.echo(f"hosts on {b['subnet']} (bridge {b['bridge']}) behind the bastion {b['name']} (host 0)")
    rows = [("HOST", "ADDRESS", "NETNS", "SSHD", "LINK")]
    for s in lab.status():
        rows.append((
            s.host.name,
            s.host.address,
            s.host.netns + ("" if s.netns and s.holder_alive else " (gone)"),
            f"up (pid {s.sshd_pid})" if s.sshd_alive else "down",
            "up" if s.link_up else "down",
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if st.get("bastion"):
        click.echo(f"ssh_config: {lab.ssh_config_path}")
    click.echo(f"inventory: {lab.inventory_path}")


@lab_group.command("sshd")
@click.argument("action", type=click.Choice(["stop", "start"]))
@click.argument("index", type=int)
@_name_option
def lab_sshd(action: str, index: int, name: str) -> None:
    """Stop or start host INDEX's sshd (fault injection); 0 is the bastion."""
    Lab(name).sshd(index, action == "start")
    click.echo(f"lab {name}: host {index} sshd {'started' if action == 'start' else 'stopped'}")


@lab_group.command("link")
@click.argument("action", type=click.Choice(["down", "up"]))
@click.argument("index", type=int)
@_name_option
def lab_link(action: str, index: int, name: str) -> None:
    """Take host INDEX's network link down or up (fault injection); 0 is the bastion's outer link."""
    Lab(name).link(index, action == "up")
    click.echo(f"lab {name}: host {index} link {action}")
