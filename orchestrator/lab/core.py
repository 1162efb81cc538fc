"""The Lab: one named simulated cluster, its names and paths, and what callers do with it (up,
down, status, exec, ssh, sshd and link faults). The work is done by the modules beside this one."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..errors import LabError
from . import access, build, mounts, network, processes, render, state as labstate, teardown
from . import slurm as labslurm  # up() has a flag named slurm
from .model import (BASTION_INDEX, DEFAULT_ROOT, HEAD_INDEX, HOLDER_COMM, HOST_PREFIX, MAX_HOSTS, NETNS_DIR,
                    SLOTS, SSH_PORT, SUBNET_PREFIX, USER_ID, HostStatus, LabHost, validate_name, validate_port,
                    validate_shared, validate_user)
from .pids import holder_alive, pid_alive, root_pid
from .system import DOWN_TOOLS, UP_TOOLS, host_python, nsenter_run, preflight, write
from .versions import parse_vary


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
        """This machine's bridge (198.18.K.1): the hosts', or network A with --bastion (the bastion's
        front) or --dual-homed-head (host 1's front)."""
        return f"ol-br-{self.name}"

    @property
    def hosts_bridge_name(self) -> str:
        """The bridge of the hosts behind a bastion or a dual-homed head (network B; no address of
        this machine on it)."""
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

    def back_veth_name(self, i: int = BASTION_INDEX) -> str:
        """Root-side veth of a jump host's NIC on the hosts' bridge (the bastion's, i = 0, or a
        dual-homed head's, i = 1); its front one, on this machine's bridge, is veth_name(i)."""
        return f"ol{self.name}-{i}b"

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
        ``ssh -F <this> NAME-h2 hostname`` (through the bastion with --bastion, through host 1
        with --dual-homed-head)."""
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
        return self.sshd_log(BASTION_INDEX)

    # ---- state

    def exists(self) -> bool:
        return self.state_path.is_file()

    def state(self) -> dict:
        """lab.json (state.py); LabError naming `orch lab up` when there is no such lab."""
        return labstate.read(self.state_path, self.name)

    @property
    def hosts(self) -> list[LabHost]:
        return [labstate.host_from(h) for h in self.state()["hosts"]]

    @property
    def subnet(self) -> str:
        """The subnet of this machine's bridge (the hosts', unless they are behind a bastion or
        a dual-homed head: then network A, the bastion's or host 1's front)."""
        return self.state()["subnet"]

    @property
    def hosts_subnet(self) -> str:
        """The subnet the hosts are on (behind the bastion with --bastion; network B, the
        training network, with --dual-homed-head)."""
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
        return labstate.host_from(rec) if rec else None

    @property
    def jump_host(self) -> LabHost | None:
        """The host this machine enters the lab through (the bastion, or host 1 of a lab made
        with --dual-homed-head), or None when it reaches every host itself."""
        rec = labstate.jump(self.state())
        return labstate.host_from(rec) if rec else None

    def host(self, i: int) -> LabHost:
        """Host i (1..N); 0 is the bastion of a lab made with --bastion. Its address is the one
        this machine reaches it by (host 1's network-A one with --dual-homed-head)."""
        return labstate.host_from(labstate.record(self.state(), i, self.name))

    def peer_address(self, i: int) -> str:
        """The address the other lab hosts reach host i by: its address on the hosts' network
        (host 1's network-B address with --dual-homed-head, the bastion's inner one), which is
        host(i).address for every other host."""
        rec = labstate.record(self.state(), i, self.name)
        return rec.get("back_address") or rec["address"]

    # ---- up

    def up(self, n: int, vary: Iterable[str] | Mapping | None = None, refuse_key: Iterable[int] = (),
           slurm: bool = False, *, ssh_port: int = SSH_PORT, user: str = "root", bastion: bool = False,
           dual_homed_head: bool = False, shared: str | None = None) -> Lab:
        """Replace any lab of this name with n fresh hosts (with a Slurm across them if `slurm`);
        returns self. `ssh_port`: every sshd listens there; `user`: the inventory's user, an
        ordinary account (uid 4300) on every host; `bastion`: the hosts are reachable only
        through a bastion host; `dual_homed_head`: only host 1 is reachable from here (network
        A), and it is on the hosts' network B too, their way in (see orchestrator/lab/access.py)."""
        ssh_port = validate_port(ssh_port)
        user = validate_user(user)
        shared = validate_shared(shared) if shared is not None else None
        if bastion and dual_homed_head:
            raise LabError("a lab cannot have both --bastion and --dual-homed-head",
                           hint="--bastion: a jump host that is no training host; --dual-homed-head: host 1 "
                                "is both; pick one")
        for other, flag in ((bastion, "--bastion"), (dual_homed_head, "--dual-homed-head")):
            if slurm and other:
                raise LabError(f"a lab cannot have both --slurm and {flag}",
                               hint="Slurm's controller runs on this machine and must reach every slurmd; "
                                    "drop one of the two")
        tools = preflight(UP_TOOLS + (tuple(labslurm.TOOLS) if slurm else ()))
        python = host_python()  # the hosts' python3: this machine's system one (LabError if none)
        if not isinstance(n, int) or not 1 <= n <= MAX_HOSTS:
            raise LabError(f"a lab has 1..{MAX_HOSTS} hosts, not {n!r}")
        plan_vary = parse_vary(vary)
        for idx in plan_vary:
            if isinstance(idx, int) and not 1 <= idx <= n:
                raise LabError(f"--vary names host {idx}, but the lab has hosts 1..{n}")
        refuse = set()
        for idx in refuse_key or ():
            if not isinstance(idx, int) or not 1 <= idx <= n:
                raise LabError(f"--refuse-key names host {idx!r}, but the lab has hosts 1..{n}")
            refuse.add(idx)
        mounts.check_root(self.root, user != "root")
        passwd = group = None
        if user != "root":
            # per-host copies of the machine's files (only read here), bound over /etc/passwd and /etc/group
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            passwd = render.passwd_with_user(Path("/etc/passwd").read_text(), user, f"/home/{user}", shell)
            group = render.group_with_user(Path("/etc/group").read_text(), user)

        self.down()
        with mounts.locked(self.root):
            k = network.pick_subnet(self.root, self.name)
            behind = bastion or dual_homed_head  # the hosts are on a second network, this machine not
            m = network.pick_subnet(self.root, self.name, also_used={k}, salt="b") if behind else k
            if dual_homed_head and m < k:
                # host 1's controller-side address sorts first, so it is the launch host (hosts are
                # ranked by address), as a login node that also trains is: the case this topology is for
                k, m = m, k
            self.state_dir.mkdir(mode=0o755)
            created = mounts.claim(self.root, ("/home",) if user != "root" else ())
            hosts = [
                LabHost(i, self.host_name(i),
                        f"{SUBNET_PREFIX}.{k if dual_homed_head and i == HEAD_INDEX else m}.{HOST_PREFIX + i}",
                        self.netns_name(i), self.veth_name(i))
                for i in range(1, n + 1)
            ]
            state = labstate.new(self, hosts, k=k, m=m, ssh_port=ssh_port, user=user, bastion=bastion,
                                 dual_homed_head=dual_homed_head, vary=plan_vary, refuse=refuse,
                                 created=created, python=python, now=time.time())
            if shared is not None:   # one directory every host mounts at `shared` (render.setup_script)
                state["shared"] = shared
                (self.state_dir / "shared").mkdir(mode=0o755)
                if user != "root":
                    os.chown(self.state_dir / "shared", USER_ID, USER_ID)
            labstate.save(self.state_path, state)
        try:
            if passwd is not None and group is not None:
                write(self.state_dir / "passwd", passwd)
                write(self.state_dir / "group", group)
            build.build(self, state, hosts, plan_vary, refuse, tools)
            if slurm:
                self._start_slurm(state, hosts, ssh_port=ssh_port, user=user)
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

    def _start_slurm(self, state: dict, hosts: list[LabHost], *, ssh_port: int, user: str) -> None:
        state["slurm"] = labslurm.start(self.state_dir, self.name, state["k"], state["gateway"], hosts,
                                     lambda i: processes.enter(processes.holder(self, i)))
        text = labslurm.inventory_yaml(self.name, len(hosts), Path(state["slurm"]["conf"]), self.key_path,
                                    self.known_hosts_path, SLOTS)
        if user != "root" or ssh_port != SSH_PORT:
            head = "defaults: {user: root,"
            if head not in text:
                raise LabError("cannot put --user/--ssh-port into the Slurm inventory (its format changed)")
            text = text.replace(head, f"defaults: {{user: {access.yaml_str(user)}, port: {ssh_port},", 1)
        write(self.slurm_inventory_path, text)
        labstate.save(self.state_path, state)

    # ---- faults: sshd and link

    def sshd(self, i: int, on: bool) -> None:
        """Stop (the host refuses connections; open sessions live on) or start host i's sshd."""
        preflight(("nsenter",))
        h = self.host(i)
        state = self.state()
        rec = labstate.record(state, i, self.name)
        pid = processes.sshd_pid(self, i)
        if on:
            if pid:
                return
            rec["sshd_pid"] = processes.start_sshd(self, h)
        else:
            processes.stop_sshd(self, i, pid)
            rec["sshd_pid"] = None
        labstate.save(self.state_path, state)

    def link(self, i: int, up: bool) -> None:
        """Take host i's link down (it vanishes from the network) or bring it back. The bastion's
        (i = 0) is its NIC on this machine's bridge: down, no host can be reached from here; so
        is host 1's with --dual-homed-head (its network-B NIC stays up)."""
        preflight(("ip",))
        network.set_link(self.host(i), up)

    def root_pid(self, i: int, pid: int) -> int | None:
        """The pid, as this machine's root PID namespace sees it, of the process that is `pid` on host i
        (what ``echo $!`` printed over ssh); None if there is no such process."""
        found = root_pid(processes.holder(self, i), int(pid))
        return found if pid_alive(found) else None

    # ---- exec / ssh

    def exec(self, i: int, argv: Sequence[str], *, input: str | None = None, timeout: float = 60,
             check: bool = False, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv on host i (0: the bastion): inside its net+uts+mount+pid namespaces (as root, cwd /).

        Text output. ``ps``/``/proc`` show the host's processes; pids are host-local.
        """
        holder = processes.holder(self, i)
        res = nsenter_run([*processes.enter(holder), "--", *argv], input=input, timeout=timeout,
                          env=dict(env) if env is not None else None,
                          what=f"{self.host_name(i)}: {shlex.join(argv)}")
        if check and res.returncode != 0:
            raise LabError(f"{self.host_name(i)}: {shlex.join(argv)} failed (exit {res.returncode}): "
                           f"{res.stderr.strip()[-300:]}")
        return res

    def ssh_argv(self, i: int, command: str | None = None, *, connect_timeout: int = 5,
                 user: str | None = None) -> list[str]:
        """The system ssh client's argv to reach host i (0: the bastion) as `user` (default root)
        with the lab's key and port (reads nothing in ~/.ssh); through the jump host (the
        bastion, or host 1 with --dual-homed-head), as the same user, when the lab has one."""
        state = self.state()
        h = labstate.host_from(labstate.record(state, i, self.name))
        jrec = labstate.jump(state)
        return access.ssh_argv(h.address, key=self.key_path, known_hosts=self.known_hosts_path,
                               port=state.get("ssh_port") or SSH_PORT, user=user or "root",
                               bastion=jrec["address"] if jrec and i != jrec["index"] else None,
                               command=command, connect_timeout=connect_timeout)

    def ssh(self, i: int, command: str, *, timeout: float = 30, connect_timeout: int = 5,
            input: str | None = None, user: str | None = None) -> subprocess.CompletedProcess:
        """Run a shell command on host i over real SSH (as `user`, default root); never raises for
        a non-zero exit."""
        try:
            return subprocess.run(self.ssh_argv(i, command, connect_timeout=connect_timeout, user=user),
                                  input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 255, exc.stdout or "", f"timed out after {timeout:g}s")

    # ---- status and down

    def status(self) -> list[HostStatus]:
        """One per host, 1..N; then the bastion's (host.index 0), if the lab has one."""
        preflight(DOWN_TOOLS)
        out = []
        for rec in labstate.all_records(self.state()):
            h = labstate.host_from(rec)
            pid = processes.sshd_pid(self, h.index, rec.get("holder_pid"))
            out.append(HostStatus(
                host=h,
                netns=os.path.exists(f"{NETNS_DIR}/{h.netns}"),
                holder_pid=rec.get("holder_pid"),
                holder_alive=holder_alive(rec.get("holder_pid")),
                sshd_pid=pid,
                sshd_alive=pid is not None,
                link_up=network.link_up(h.veth),
            ))
        return out

    def down(self) -> bool:
        """Remove the lab completely; True if there was anything to remove. Idempotent."""
        return teardown.down(self)

