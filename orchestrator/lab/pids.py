"""Processes and namespaces as /proc shows them: is a pid alive (and what is its comm), a
host's init (the holder), a pid's children, namespace inodes, and a host-local pid turned
into this machine's root-namespace one. Reads /proc only; never signals."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .model import HOLDER_COMMS


def pid_alive(pid: int | None, comm: str | None = None) -> bool:
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


def holder_alive(pid: int | None) -> bool:
    return any(pid_alive(pid, comm) for comm in HOLDER_COMMS)


def nspid(pid: int) -> int | None:
    """pid's number in its own (innermost) PID namespace, from the NSpid line of its status."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def children(pid: int) -> list[int]:
    """pid's child processes (needs CONFIG_PROC_CHILDREN; else a scan of PPid lines)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        pass
    out = []
    for p in proc_pids():
        try:
            with open(f"/proc/{p}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        with contextlib.suppress(IndexError, ValueError):
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(p)
    return out


def root_pid(holder: int, host_pid: int) -> int | None:
    """The pid (as this process sees it) of the process that is `host_pid` in holder's PID namespace."""
    ns = ns_inode(f"/proc/{holder}/ns/pid")
    if ns is None:
        return None
    if ns == ns_inode("/proc/self/ns/pid"):  # a holder without a PID namespace of its own (older labs)
        return host_pid if pid_alive(host_pid) else None
    if host_pid == 1:
        return holder
    seen = set()
    # daemons are children of the init; anything else (an nsenter child...) needs the full scan
    for group in (children(holder), proc_pids()):
        for pid in group:
            if pid in seen:
                continue
            seen.add(pid)
            if nspid(pid) == host_pid and ns_inode(f"/proc/{pid}/ns/pid") == ns:
                return pid
    return None


def ns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def proc_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def same_file(a: str | Path, b: str | Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
