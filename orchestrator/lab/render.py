"""Pure text of a lab host's own files: /etc/hccn.conf, /etc/hosts, /root/.bashrc,
~/.ssh/environment, sshd_config, /etc/passwd and /etc/group (with --user), setup.sh (the
host's first process: addresses, hostname, mounts) and the init it execs. No I/O: every
input (this machine's /etc/hosts, /etc/passwd...) is an argument."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import LabError
from .model import HOST_PREFIX, SSH_PORT, USER_ID, HostPlan, LabHost

SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def hccn_conf(index: int, devices: int = 8) -> str:
    """Text of a host's /etc/hccn.conf: one subnet per device index, one address per host."""
    lines = []
    for d in range(devices):
        lines.append(f"address_{d}=192.168.{100 + d}.{HOST_PREFIX + index}")
        lines.append(f"netmask_{d}=255.255.255.0")
    return "\n".join(lines) + "\n"


def etc_hosts(base: str, lab: str, hosts: Sequence[LabHost], bastion: tuple[str, str] | None = None) -> str:
    """A host's /etc/hosts: this machine's (`base`) plus every lab host's name; `bastion` is
    (its address on the hosts' network, its name)."""
    text = base.rstrip("\n") + f"\n# orch lab {lab}\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
    if bastion:
        text += f"{bastion[0]} {bastion[1]}\n"
    return text


def bashrc(base: str) -> str:
    """A host's /root/.bashrc: this machine's (`base`), not read by non-interactive shells."""
    return ("# orch lab: non-interactive shells (ssh HOST CMD) keep PATH from ~/.ssh/environment\n"
            "case $- in *i*) ;; *) return ;; esac\n" + base)


def host_path_env(site: bool, lib: bool) -> str:
    """Contents of a host's ~/.ssh/environment: PATH is the --vary shims, then a real host's
    standard PATH (so ``python3`` is this machine's system python3, system.host_python: never
    the controller's venv or pyenv); PYTHONPATH/LD_LIBRARY_PATH only where --vary put something."""
    out = [f"PATH=/opt/orch-lab/bin:{SBIN_PATH}"]
    if site:
        out.append("PYTHONPATH=/opt/orch-lab/site")
    if lib:
        out.append("LD_LIBRARY_PATH=/opt/orch-lab/lib")
    return "\n".join(out) + "\n"


def path_dirs() -> list[str]:
    """The dirs of a host's non-interactive PATH."""
    return host_path_env(False, False).split("=", 1)[1].strip().split(":")


def sshd_config(host: LabHost, hdir: Path, port: int = SSH_PORT, max_startups: str = "200:30:400",
                also: Sequence[str] = ()) -> str:
    """`also`: more addresses to listen on (a dual-homed head's on the hosts' network)."""
    return "\n".join([
        f"# sshd of orch lab host {host.name}",
        *(f"ListenAddress {a}" for a in (host.address, *also)),
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


def _with_entry(base: str, what: str, user: str, line: str) -> str:
    """`base` (this machine's /etc/passwd or /etc/group) plus the lab user's `line`; refuses a
    name or id already there."""
    for existing in base.splitlines():
        f = existing.split(":")
        if len(f) >= 3 and (f[0] == user or f[2] == str(USER_ID)):
            kind = "uid" if what == "passwd" else "gid"
            raise LabError(
                f"--user {user}: /etc/{what} already has {f[0]!r} ({kind} {f[2]})",
                hint=f"pick a user name not on this machine; the lab user gets {kind} {USER_ID}",
            )
    return base.rstrip("\n") + f"\n{line}\n"


def passwd_with_user(base: str, user: str, home: str, shell: str) -> str:
    return _with_entry(base, "passwd", user, f"{user}:*:{USER_ID}:{USER_ID}:orch lab user:{home}:{shell}")


def group_with_user(base: str, user: str) -> str:
    return _with_entry(base, "group", user, f"{user}:x:{USER_ID}:")


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


def setup_script(p: HostPlan, *, state_dir: Path, init_path: Path, user: str = "root",
                 hide_exes: Mapping[str, Sequence[str]] | None = None, hide_dists: Sequence[Path] = (),
                 shared: str | None = None) -> str:
    """Text of h<i>/setup.sh: run as PID 1 of host p's fresh net+uts+mount+pid namespaces, it
    sets the addresses and hostname, mounts the host's own /proc, /sys, /data, /tmp, /root
    (an overlay), /etc files and /opt/orch-lab from p.dir, hides what --vary ...=none hides
    (`hide_exes`: dir -> OpenMPI names in it; `hide_dists`: dist-info dirs under /root),
    prints "ready" and execs the init."""
    d, h, q = p.dir, p.host, shlex.quote
    ssh, opt, tmp, rootov = d / "ssh", d / "opt", d / "tmp", d / "rootov"
    script = [
        "set -e",
        f"# orch lab: set up host {h.name} inside its fresh net+uts+mount+pid namespaces (this is PID 1)",
        "mount -t proc -o nosuid,nodev,noexec proc /proc",
        "ip link set lo up",
        f"ip addr add {h.address}/24 dev eth0",
        "ip link set eth0 up",
    ]
    if p.back_address:
        # a jump host (the bastion, a dual-homed head): a second NIC on the hosts' network, and no
        # forwarding between the two
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
        f"mount -t tmpfs -o mode=0755 orch-lab-root {q(str(rootov))}",
        f"mkdir {q(str(rootov / 'upper'))} {q(str(rootov / 'work'))}",
        "mount -t overlay orch-lab-root -o "
        + q(f"lowerdir=/root,upperdir={rootov / 'upper'},workdir={rootov / 'work'}") + " /root",
        "rm -rf /root/.ssh && mkdir -m 700 /root/.ssh",
        f"mount --bind {q(str(ssh))} /root/.ssh",
        f"cat {q(str(d / 'bashrc'))} > /root/.bashrc",
    ]
    if shared:  # --shared: one directory of the lab (state_dir/shared) in every host, as NFS would be
        script += [f"mkdir -p {q(shared)}", f"mount --bind {q(str(state_dir / 'shared'))} {q(shared)}"]
    if user != "root":
        script += [
            f"mount --bind {q(str(state_dir / 'passwd'))} /etc/passwd",
            f"mount --bind {q(str(state_dir / 'group'))} /etc/group",
            # /home: an overlay like /root (the real homes stay visible, writes stay on the host)
            f"mkdir {q(str(rootov / 'homeup'))} {q(str(rootov / 'homework'))}",
            "mount -t overlay orch-lab-home -o "
            + q(f"lowerdir=/home,upperdir={rootov / 'homeup'},workdir={rootov / 'homework'}") + " /home",
            f"mkdir -p {q('/home/' + user)}",
            f"mount --bind {q(str(d / 'home'))} {q('/home/' + user)}",
            # the user may run what lives under /root (a venv like /opt/orch-venvs/train may link
            # to pyenv's python there); /root's own mode changes only in this host's overlay
            "chmod 711 /root",
        ]
    if p.versions.get("openmpi") == "none":
        for n, (dirpath, names) in enumerate(sorted((hide_exes or {}).items())):
            if not dirpath.startswith("/root/"):  # /root is an overlay already
                up, work = rootov / f"hide{n}", rootov / f"hide{n}.work"
                script += [f"mkdir {q(str(up))} {q(str(work))}",
                           "mount -t overlay orch-lab-hide -o "
                           + q(f"lowerdir={dirpath},upperdir={up},workdir={work}") + f" {q(dirpath)}"]
            script.append("rm -f " + " ".join(q(f"{dirpath}/{x}") for x in names))
    script += [f"rm -rf {q(str(dist))}" for dist in hide_dists]
    script += [
        f"mount --bind {q(str(tmp))} /tmp",
        "cd /",
        "echo ready",
        f"exec {q(str(init_path))} </dev/null",
    ]
    return "\n".join(script) + "\n"
