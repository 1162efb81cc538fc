"""The lab's names, numbers and records: constants, LabHost/HostStatus and the checks of
what a user may name (lab name, --ssh-port, --user). No I/O."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError

DEFAULT_ROOT = "/var/tmp/orch-lab"
NAME_RE = re.compile(r"[a-z0-9]{1,8}")
MAX_HOSTS = 240  # .11 .. .250 of the lab's /24
SUBNET_PREFIX = "198.18"
SSH_PORT = 22
SLOTS = 2
HOST_PREFIX = 10  # host i has .(10+i)
STATE_VERSION = 1
NETNS_DIR = "/run/netns"

# PID 1 of every lab host's PID namespace: h<i>/setup.sh execs <state dir>/orch-lab-init
# (a python script, so its comm is this name). "sleep" is what older labs hold with.
HOLDER_COMM = "orch-lab-init"
HOLDER_COMMS = (HOLDER_COMM, "sleep")

USER_ID = 4300              # uid and gid of the --user account on every host
BASTION_INDEX = 0           # Lab.host(0), Lab.exec(0, ...), `orch lab sshd stop 0`: the bastion
HEAD_INDEX = 1              # --dual-homed-head: the host on both networks, the others' way in
BASTION_MAX_STARTUPS = "10:30:100"  # OpenSSH's default: a connection storm meets the real limit
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
# what every lab host mounts a directory of its own over (render.setup_script): this machine's
# files there are out of the hosts' sight
HOST_PRIVATE = ("/tmp", "/data", "/opt/orch-lab", "/root/.ssh", "/home")


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
class HostPlan:
    """What `up` makes of one host: its files' dir, its --vary versions, --refuse-key."""

    host: LabHost
    dir: Path
    versions: dict[str, str] = field(default_factory=dict)
    refuse_key: bool = False
    back_address: str | None = None  # the jump host's address on the hosts' bridge (the bastion, a dual-homed head)


def host_visible(path: str) -> bool:
    """Does a lab host see this machine's `path` (an absolute, normalised path)?"""
    return not any(path == d or path.startswith(d + "/") for d in HOST_PRIVATE)


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise LabError(
            f"bad lab name {name!r}",
            hint="a lab name is 1-8 characters of a-z and 0-9, e.g. --name t1",
        )
    return name


def validate_port(port) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise LabError(f"bad ssh port {port!r}", hint="--ssh-port takes 1..65535, e.g. 2222")
    return port


SHARED_UNDER = "/data"   # a shared mount there is made in each host's own /data; elsewhere it must exist here


def validate_shared(path) -> str:
    """`--shared PATH`: an absolute, plain path, either under /data (made in every host's own
    /data) or an existing directory of this machine that no lab host mounts over (/data/... is
    the usual choice: /data/shared, as an NFS or Lustre mount would be)."""
    import posixpath

    if not isinstance(path, str) or not path.startswith("/") or posixpath.normpath(path) != path or path == "/":
        raise LabError(f"--shared {path!r}: an absolute path without '..' or a trailing '/' is needed",
                       hint="e.g. --shared /data/shared")
    if path == SHARED_UNDER or path.startswith(SHARED_UNDER + "/"):
        if path == SHARED_UNDER:
            raise LabError("--shared /data: every host keeps its own /data; share a directory in it",
                           hint="e.g. --shared /data/shared")
        return path
    if any(path == p or path.startswith(p + "/") for p in HOST_PRIVATE + ("/proc", "/sys", "/dev", "/etc", "/run")):
        raise LabError(f"--shared {path}: lab hosts mount their own files there", hint="e.g. --shared /data/shared")
    if not os.path.isdir(path) or os.path.islink(path):
        raise LabError(f"--shared {path}: no such directory on this machine (outside /data it must exist, "
                       "as an NFS mountpoint would)", hint="create it, or use a path under /data: --shared /data/shared")
    return path


def validate_user(user) -> str:
    if not isinstance(user, str) or not USER_RE.fullmatch(user):
        raise LabError(f"bad lab user name {user!r}",
                       hint="a user name is a-z, 0-9, _ and -, starting with a letter or _, e.g. --user train")
    return user


def subnet_octet(name: str) -> int:
    """The lab's preferred third octet, 1..250, stable from its name."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 250 + 1
