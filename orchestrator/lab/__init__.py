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
        ssh_config          OpenSSH client config: every host by its name (ProxyJump with --bastion
                            or --dual-homed-head)
        passwd, group       with --user: the copies bound over /etc/passwd and /etc/group
        h<i>/               host i: sshd_config, sshd.log, sshd.pid, host key,
                            data/ (-> /data), ssh/ (-> /root/.ssh), opt/ (-> /opt/orch-lab),
                            tmp/ (-> /tmp), hccn.conf, hosts, bashrc, setup.sh,
                            home/ (-> /home/USER with --user); h0/ is the bastion's

Network: bridge ``ol-br-NAME`` in the root namespace holds 198.18.K.1/24 (K is derived
from NAME, recorded in lab.json, and never shared by two labs); host i is netns
``olab-NAME-i`` with ``eth0`` = 198.18.K.(10+i), its root-side veth is ``olNAME-i``.
Hosts have no default route: they reach each other and the controller, nothing else.

Options (orchestrator/lab/access.py has the details), each recorded in lab.json:
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
  --dual-homed-head  (``dual_homed_head``: the hosts' network ``k``/``subnet``/``bridge``) the
                launch host is the bastion: host 1 alone is on this machine's bridge (network A,
                eth0 = 198.18.K.11) and also on the hosts' bridge ``ol-bh-NAME`` (network B,
                198.18.M.0/24 reserved like the bastion's, ``unreachable`` here; eth1 = 198.18.M.11,
                root-side veth ``olNAME-1b``), where hosts 2..N are (eth0 = 198.18.M.(10+i)). Host 1's
                sshd listens on both addresses, no IP forwarding; every host's /etc/hosts names host 1
                by its B address. The inventory lists host 1 by its A address (no ``jump``, no
                ``mpi_address``) and hosts 2..N with ``jump: USER@HOST1:PORT``; ssh_config gives them
                ProxyJump to host 1. ``Lab.jump_host`` is host 1, ``Lab.peer_address(1)`` its B
                address; ``Lab.ssh(i, ...)`` goes through it; ``link down 1`` cuts network A only.

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
``PATH=/opt/orch-lab/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin``
(plus PYTHONPATH=/opt/orch-lab/site / LD_LIBRARY_PATH=/opt/orch-lab/lib where a
--vary put something there): a real host's standard PATH. So ``python3`` over ssh is this
machine's system python3 (system.host_python: the first on that PATH, /usr/bin/python3 on
Debian; ``apt-get install python3`` where there is none), with its standard library and
nothing of the controller's: never the venv or pyenv python that runs orch, so orch, paramiko
and pydantic are not importable on a host, as on a real one. It also runs each host's init
and is the real interpreter behind a ``--vary I:python=X`` version shim. What a job needs
beyond that (MindSpore, torch, mpi4py) it names itself, as on a real cluster: the playbooks
and tests/e2e put /opt/orch-venvs/train/bin (scripts/install-e2e-deps.sh) first on PATH
through ``job.env``. Because bash sources ~/.bashrc for ssh commands and this machine's
/root/.bashrc prepends pyenv shims, each host's /root/.bashrc (in its /root overlay; the
real file is untouched) returns early for non-interactive shells.

Versions (``--vary I:TOOL=VERSION``, ``--vary '*:TOOL=VERSION'`` or ``--all TOOL=VERSION``;
a host's own entry wins over ``*``):
  openmpi=V   /opt/orch-lab/bin/{mpirun,mpiexec,ompi_info} shims print the real output
              with the version replaced; anything else runs the real tool.
  openmpi=none  every OpenMPI executable name (mpirun, orted, ompi_info, mpicc...) is
              removed from the PATH dirs inside that host's mount namespace (a tmpfs
              overlay over /usr/bin with whiteouts): ``command -v mpirun`` fails.
              (Covering the files with a non-executable bind mount is not enough:
              bash's ``command -v`` still prints a non-executable match.)
  python=V    /opt/orch-lab/bin/python3 (and python) answer --version/-V with V (and run the
              system python3 otherwise).
  nccl=V      empty /opt/orch-lab/lib/libnccl.so.V + libnccl.so.<major> symlink.
  other=V     any Python distribution (mindspore, torch...): a fake
              /opt/orch-lab/site/<name>-V.dist-info/METADATA.
  other=none  no shim; if the hosts' python3 sees it installed under /root (pip --user), its
              dist-info is removed inside that host's /root overlay (elsewhere: an error).

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

The package (``orchestrator.lab``; ``orch lab ...`` is orchestrator/cli_lab.py)::

    core.py       Lab: names and paths, up, down, status, exec, ssh, sshd/link faults
    model.py      constants, LabHost/HostStatus/HostPlan, name/port/user checks (no I/O)
    state.py      lab.json: read, save, host records
    render.py     pure text of a host's files: hccn.conf, hosts, sshd_config, passwd, setup.sh, init
    access.py     pure text for reaching the lab: inventory, known_hosts, ssh_config, ssh argv
    versions.py   --vary: parsing, version shims, a host's /opt/orch-lab
    build.py      what up makes: keys, host dirs, network, inits, sshds, inventory
    network.py    subnets, bridges, namespaces, veths, link up/down, reachability
    processes.py  a host's init (holder) and sshd: start, wait, stop
    pids.py       /proc: liveness, children, namespaces, host-local -> root pids
    mounts.py     the shared mountpoints on the real fs and the lab root's lock
    teardown.py   down: processes, network, state dir, mountpoints; list_labs
    slurm.py      a real Slurm in the lab (--slurm): slurm.conf, munged, slurmctld, slurmd
    system.py     tools (preflight), running them, file helpers
"""

from __future__ import annotations

from .core import Lab
from .model import DEFAULT_ROOT, HOLDER_COMM, SSH_PORT, HostStatus, LabHost, validate_name
from .pids import pid_alive
from .system import preflight, which
from .teardown import list_labs
from .versions import parse_vary

__all__ = ["DEFAULT_ROOT", "HOLDER_COMM", "SSH_PORT", "HostStatus", "Lab", "LabHost", "list_labs", "parse_vary",
           "pid_alive", "preflight", "validate_name", "which"]
