"""A lab host's processes: its init (the holder of its uts+mount+pid namespaces, started with
setup.sh), its sshd (started inside those namespaces with nsenter, waited for, stopped), and
pids seen from here. `lab` is a Lab (names, paths, state)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

from ..errors import LabError
from . import network, state
from .model import HOLDER_COMM, NETNS_DIR, SSH_PORT, HostPlan, LabHost
from .pids import holder_alive, ns_inode, pid_alive, read_pid, root_pid
from .system import nsenter_run, run, which

if TYPE_CHECKING:
    from .core import Lab


def enter(holder: int) -> list[str]:
    """nsenter argv prefix into a host's net+uts+mount+pid namespaces (nsenter forks for -p)."""
    return ["nsenter", "-t", str(holder), "-n", "-u", "-m", "-p"]


def holder(lab: Lab, i: int) -> int:
    """Host i's init, as this machine sees it; LabError if the host is gone."""
    rec = state.record(lab.state(), i, lab.name)
    pid = rec.get("holder_pid")
    ns = ns_inode(f"{NETNS_DIR}/{rec['netns']}")
    if pid is None or not holder_alive(pid) or ns is None or ns_inode(f"/proc/{pid}/ns/net") != ns:
        raise LabError(
            f"{rec['name']}: the lab host is gone (its namespace holder, pid {pid}, is not running)",
            hint=f"recreate the lab: orch lab up N --name {lab.name}",
        )
    return pid


def start_holder(p: HostPlan, unshare: str) -> int:
    """Run p's setup.sh as PID 1 of new uts+mount+pid namespaces in p's netns; its init's pid.

    One `nsenter --net .. unshare .. --pid sh -c 'sh setup.sh &'`. unshare --pid without
    --fork: the outer sh stays in this PID namespace (so its $! is the holder's pid as seen
    from here) and its first child, setup.sh, is PID 1 of the new one; setup.sh prints "ready"
    and execs the init, which closes the pipe once it runs. nsenter --net, not `ip netns exec`:
    that remounts /sys, hiding /sys/fs/cgroup (which slurmd needs); setup.sh mounts the
    namespace's own sysfs and keeps the cgroup tree."""
    res = run(["nsenter", f"--net={NETNS_DIR}/{p.host.netns}", unshare, "--uts", "--mount",
               "--propagation", "private",
               "--pid", "/bin/sh", "-c", '/bin/sh "$1" & echo "$!"', "sh", str(p.dir / "setup.sh")],
              check=False, timeout=60, start_new_session=True)
    out = res.stdout.split()
    found = [int(x) for x in out if x.isdigit()]
    if res.returncode != 0 or "ready" not in out or len(found) != 1 or not pid_alive(found[0], HOLDER_COMM):
        raise LabError(
            f"{p.host.name}: setting up the host failed (exit {res.returncode}): "
            f"{(res.stderr or res.stdout).strip()[-500:] or 'the init did not start'}",
            hint=f"see {p.dir / 'setup.sh'}",
        )
    return found[0]


def start_sshd(lab: Lab, h: LabHost, wait: bool = True) -> int | None:
    """Start host h's sshd in its namespaces; with `wait`, its root-namespace pid once it answers."""
    d = lab.host_dir(h.index)
    init = holder(lab, h.index)
    with contextlib.suppress(FileNotFoundError):
        (d / "sshd.pid").unlink()
    sshd = which("sshd") or "/usr/sbin/sshd"
    # sshd daemonises at once: its daemon is reparented to the host's init, the short-lived
    # first sshd (nsenter's child, in the host's PID namespace) is reaped by nsenter.
    res = nsenter_run([*enter(init), sshd, "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")],
                      timeout=30, what=f"{h.name}: starting sshd")
    if res.returncode != 0:
        raise LabError(
            f"{h.name}: sshd did not start (exit {res.returncode}): {log_tail(lab, h.index)}",
            hint=f"see {d / 'sshd.log'} and {d / 'sshd_config'}",
        )
    if wait:
        deadline = time.monotonic() + 15
        pid = wait_sshd_pid(lab, h, deadline, init)
        await_reachable(lab, [h], deadline)
        return pid
    return None


def stop_sshd(lab: Lab, i: int, pid: int | None) -> None:
    """Stop host i's sshd (`pid`: its root-namespace pid, None if it is not running)."""
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(FileNotFoundError):
        (lab.host_dir(i) / "sshd.pid").unlink()


def sshd_pid(lab: Lab, i: int, init: int | None = None) -> int | None:
    """Root-namespace pid of host i's running sshd (its PidFile holds the host-local one)."""
    host_pid = read_pid(lab.host_dir(i) / "sshd.pid")
    if not host_pid:
        return None
    if init is None:
        init = state.record(lab.state(), i, lab.name).get("holder_pid")
    if init is None or not holder_alive(init):
        return None
    pid = root_pid(init, host_pid)
    return pid if pid_alive(pid, "sshd") else None


def wait_sshd_pid(lab: Lab, h: LabHost, deadline: float, init: int | None = None) -> int:
    if init is None:
        init = holder(lab, h.index)
    while True:
        pid = sshd_pid(lab, h.index, init)
        if pid:
            return pid
        if time.monotonic() > deadline:
            raise LabError(f"{h.name}: sshd did not come up: {log_tail(lab, h.index)}",
                           hint=f"see {lab.sshd_log(h.index)}")
        time.sleep(0.01)


def await_reachable(lab: Lab, hosts: list[LabHost], deadline: float) -> None:
    st = lab.state()
    network.await_reachable(hosts, int(st.get("ssh_port") or SSH_PORT), state.jump(st), deadline, lab.name)


def log_tail(lab: Lab, i: int, lines: int = 3) -> str:
    try:
        tail = lab.sshd_log(i).read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return "(no sshd log)"
    return " / ".join(tail) or "(empty sshd log)"
