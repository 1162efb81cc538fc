"""A real Slurm in a lab (`orch lab up N --slurm`): munged and slurmctld on this machine,
one slurmd inside each lab host's namespaces. Debian's slurm-wlm and munge packages.

Each lab gets its own munge key and socket and its own slurm.conf (its own controller
port), all under the lab's state dir, so labs never share Slurm state, and clients reach
a lab's Slurm with SLURM_CONF=<state dir>/slurm/slurm.conf (the inventory's
`slurm.conf:`). Facts this depends on: slurmd needs /sys/fs/cgroup mounted (the lab host
keeps the machine's cgroup tree); proctrack/linuxproc and task/none need nothing else.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Callable, Sequence

from ..errors import LabError
from .system import SLURM_TOOLS, nsenter_run, run, which

TOOLS = SLURM_TOOLS  # tool -> the Debian package that brings it

PARTITION = "main"
CTLD_PORT_BASE = 17000  # + the lab's subnet octet: one controller port per lab
NODE_CPUS = 16          # what slurmd reports (config_overrides): room for the ranks of one host


def slurm_dir(state_dir: Path) -> Path:
    return state_dir / "slurm"


def conf_path(state_dir: Path) -> Path:
    return slurm_dir(state_dir) / "slurm.conf"


def slurm_conf(lab: str, k: int, gateway: str, hosts: Sequence, sdir: Path, ctld_host: str) -> str:
    """slurm.conf of a lab: `hosts` are LabHost records (name, address)."""
    lines = [
        f"# orch lab {lab!r}: made by `orch lab up --slurm`, removed by `orch lab down`",
        f"ClusterName=orchlab{lab}",
        f"SlurmctldHost={ctld_host}({gateway})",
        f"SlurmctldPort={CTLD_PORT_BASE + k}",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={sdir / 'munge.sock'}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={sdir / 'state'}",
        f"SlurmdSpoolDir={sdir / 'spool-%n'}",
        f"SlurmctldPidFile={sdir / 'slurmctld.pid'}",
        f"SlurmdPidFile={sdir / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={sdir / 'slurmctld.log'}",
        f"SlurmdLogFile={sdir / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "MinJobAge=3600",
        "KillWait=5",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
    ]
    lines += [f"NodeName={h.name} NodeAddr={h.address} CPUs={NODE_CPUS} State=UNKNOWN" for h in hosts]
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def inventory_yaml(lab: str, n: int, conf: Path, key: Path, known_hosts: Path, slots: int) -> str:
    return (f"# orch lab {lab!r}: its Slurm ({n} nodes); made by `orch lab up --slurm`.\n"
            "# Usable unchanged as `inventory:` in a cluster.yaml: hosts come from a Slurm allocation.\n"
            f"defaults: {{user: root, identity_file: {key}, known_hosts: {known_hosts}, slots: {slots}}}\n"
            f"slurm: {{nodes: {n}, partition: {PARTITION}, conf: {conf}}}\n")


def start(state_dir: Path, lab: str, k: int, gateway: str, hosts: Sequence,
          enter: Callable[[int], list[str]]) -> dict:
    """Start munged + slurmctld here and slurmd in every host; wait until every node is idle.
    `enter(i)` is the nsenter prefix into host i. Returns the state to record."""
    sdir = slurm_dir(state_dir)
    (sdir / "state").mkdir(parents=True)
    os.chmod(sdir, 0o755)
    key = sdir / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as fh:
        fh.write(os.urandom(1024))
    run([which("munged") or "/usr/sbin/munged", "--force", f"--socket={sdir / 'munge.sock'}", f"--key-file={key}",
         f"--log-file={sdir / 'munged.log'}", f"--pid-file={sdir / 'munged.pid'}",
         f"--seed-file={sdir / 'munged.seed'}"], what="starting munged", timeout=30)
    conf = conf_path(state_dir)
    conf.write_text(slurm_conf(lab, k, gateway, hosts, sdir, socket.gethostname().split(".")[0]))  # slurmctld compares short names
    env = dict(os.environ, SLURM_CONF=str(conf))
    run([which("slurmctld") or "/usr/sbin/slurmctld", "-f", str(conf)], what="starting slurmctld", timeout=30,
        env=env)
    slurmd = which("slurmd") or "/usr/sbin/slurmd"
    for h in hosts:
        (sdir / f"spool-{h.name}").mkdir()
        res = nsenter_run([*enter(h.index), slurmd, "-N", h.name, "-f", str(conf)], timeout=30,
                          what=f"{h.name}: starting slurmd")
        if res.returncode != 0:
            raise LabError(f"{h.name}: slurmd did not start (exit {res.returncode}): "
                           f"{_tail(sdir / f'slurmd-{h.name}.log')}", hint=f"see {sdir}")
    deadline = time.monotonic() + 30
    states = ""
    while time.monotonic() < deadline:
        res = run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=10, env=env)
        states = res.stdout.strip()
        if res.returncode == 0 and states and all(line.split()[1].rstrip("*") == "idle"
                                                  for line in states.splitlines()):
            return {"conf": str(conf), "port": CTLD_PORT_BASE + k, "nodes": len(hosts)}
        time.sleep(0.2)
    raise LabError(f"the lab's Slurm nodes did not become idle within 30 s: {states or 'no answer'}; "
                   f"{_tail(sdir / 'slurmctld.log')}", hint=f"see the logs in {sdir}")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return f"(no {path.name})"


# Processes of a lab's Slurm outside its hosts' namespaces: found by their command lines,
# which name files in the lab's state dir (see teardown.lab_pids).
DAEMONS = (b"slurmctld", b"munged")
