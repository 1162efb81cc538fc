"""`down`: every process of a lab (SIGKILL until none is left), its network, its state dir, and
the shared mountpoints once no lab is left; and which labs there are (half-removed ones too)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..errors import LabError
from . import mounts, network, state as labstate
from .model import DEFAULT_ROOT, NAME_RE, NETNS_DIR
from .pids import holder_alive, ns_inode, pid_alive, proc_pids, same_file
from .slurm import DAEMONS as SLURM_DAEMONS
from .system import DOWN_TOOLS, listdir, preflight

if TYPE_CHECKING:
    from .core import Lab


def lab_pids(lab: Lab, holders: Iterable[tuple[int, int]]) -> set[int]:
    """Every live process in one of the lab's namespaces, or an sshd of its config. `holders`:
    (host index, holder pid) from the lab's state."""
    pat = re.compile(rf"olab-{re.escape(lab.name)}-\d+")
    net_inodes = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir(NETNS_DIR):
            if pat.fullmatch(entry):
                ino = ns_inode(f"{NETNS_DIR}/{entry}")
                if ino:
                    net_inodes.add(ino)
    # A holder whose netns name is already gone (an interrupted down) still counts.
    # Its PID namespace counts too, unless it is ours (a holder of an older lab has none).
    mnt_inodes = set()
    pid_inodes = set()
    my_mnt = ns_inode("/proc/self/ns/mnt")
    my_pidns = ns_inode("/proc/self/ns/pid")
    for i, pid in holders:
        if not holder_alive(pid):
            continue
        mnt = ns_inode(f"/proc/{pid}/ns/mnt")
        net = ns_inode(f"/proc/{pid}/ns/net")
        pidns = ns_inode(f"/proc/{pid}/ns/pid")
        if not mnt or not net or mnt == my_mnt:
            continue
        if net in net_inodes or same_file(f"/proc/{pid}/root/data", lab.host_dir(i) / "data"):
            mnt_inodes.add(mnt)
            net_inodes.add(net)
            if pidns and pidns != my_pidns:
                pid_inodes.add(pidns)
    marker = (str(lab.state_dir) + "/").encode()
    init = str(lab.init_path).encode()
    me = os.getpid()
    found = set()
    for pid in proc_pids():
        if pid == me:
            continue
        if (ns_inode(f"/proc/{pid}/ns/net") in net_inodes or ns_inode(f"/proc/{pid}/ns/mnt") in mnt_inodes
                or ns_inode(f"/proc/{pid}/ns/pid") in pid_inodes):
            found.add(pid)
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        # the lab's Slurm runs outside its hosts' namespaces: known by the state dir in its command line
        if marker in cmdline and (os.path.basename(argv[0]) in (b"sshd", b"sleep", *SLURM_DAEMONS)
                                  or init in argv[1:3]):
            found.add(pid)
    return {p for p in found if pid_alive(p)}


def down(lab: Lab) -> bool:
    """Remove the lab completely; True if there was anything to remove. Idempotent."""
    preflight(DOWN_TOOLS)
    state = labstate.read_or_empty(lab.state_path)
    holders = [(h["index"], h["holder_pid"]) for h in labstate.all_records(state) if h.get("holder_pid")]
    found = lab.state_dir.exists()

    # 1. processes: SIGKILL everything in the lab's namespaces until none is left
    deadline = time.monotonic() + 10
    while True:
        pids = lab_pids(lab, holders)
        if not pids:
            break
        found = True
        if time.monotonic() > deadline:
            raise LabError(f"lab {lab.name!r}: processes {sorted(pids)} survive SIGKILL",
                           hint="they may be stuck in the kernel (D state); retry orch lab down")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)

    # 2. network: veths, bridges, namespaces (a jump host's too: the bastion's netns -0 and veths
    # -0 and -0b, or a dual-homed head's back veth -1b; the hosts' bridge, the unreachable route
    # to their subnet)
    route = None
    with contextlib.suppress(KeyError, TypeError, IndexError):
        route = (labstate.jump(state) or {})["subnet"]
    if network.remove(lab.name, (lab.bridge, lab.hosts_bridge_name), route):
        found = True

    # 3. state dir, then the shared mountpoints once no lab is left
    if lab.state_dir.exists():
        shutil.rmtree(lab.state_dir)
    if lab.root.is_dir():
        with mounts.locked(lab.root):
            mounts.release(lab.root)
    return found


def list_labs(root: str | os.PathLike | None = None) -> list[str]:
    """Names of labs on this machine: state dirs, and namespaces/bridges of half-removed ones."""
    root = Path(root or os.environ.get("ORCH_LAB_ROOT") or DEFAULT_ROOT)
    names = {p.name for p in root.iterdir() if p.is_dir() and NAME_RE.fullmatch(p.name)} if root.is_dir() else set()
    for entry in listdir(NETNS_DIR):
        m = re.fullmatch(r"olab-([a-z0-9]{1,8})-\d+", entry)
        if m:
            names.add(m.group(1))
    for entry in listdir("/sys/class/net"):
        m = re.fullmatch(r"ol-b[rh]-([a-z0-9]{1,8})", entry)
        if m:
            names.add(m.group(1))
    return sorted(names)
