"""What `up` makes once the state is recorded: the keys, every host's files (h<i>/), the network,
each host's init and sshd, then the inventory and ssh_config. `lab` is a Lab (names, paths)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import access, network, processes, render, state as labstate, versions
from .model import BASTION_INDEX, BASTION_MAX_STARTUPS, SSH_PORT, USER_ID, HostPlan, LabHost
from .system import host_python, parallel, run, write

if TYPE_CHECKING:
    from .core import Lab


def build(lab: Lab, state: dict, hosts: list[LabHost], vary: dict, refuse: set[int], tools: dict) -> None:
    """Make the lab `state` describes (saving the pids into it); `tools`: preflight's paths."""
    sd = lab.state_dir
    port, user, brec, jrec = state["ssh_port"], state["user"], state.get("bastion"), labstate.jump(state)
    head = jrec["index"] if jrec and not brec else None  # a dual-homed head: host 1 is the jump host
    plans = [HostPlan(h, lab.host_dir(h.index), versions.host_versions(vary, h.index), h.index in refuse,
                      back_address=jrec["back_address"] if jrec and h.index == head else None)
             for h in hosts]
    bplan = HostPlan(labstate.host_from(brec), lab.host_dir(brec["index"]),
                     back_address=brec["back_address"]) if brec else None
    every = plans + ([bplan] if bplan else [])  # the order of state.all_records
    for p in every:
        p.dir.mkdir()

    # keys: the lab's user key + one host key per host, in parallel
    keygen = tools["ssh-keygen"]
    jobs = [[keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"orch-lab-{lab.name}", "-f", str(lab.key_path)]]
    jobs += [[keygen, "-q", "-t", "ed25519", "-N", "", "-C", p.host.name, "-f", str(p.dir / "ssh_host_ed25519_key")]
             for p in every]
    parallel(lambda argv: run(argv, what="ssh-keygen", timeout=30), jobs)
    user_pub = (sd / "id_ed25519.pub").read_text().strip()
    user_key = lab.key_path.read_text()
    entries = []
    for p in every:
        pub = (p.dir / "ssh_host_ed25519_key.pub").read_text().split(" ")
        names = [p.host.address] + ([p.back_address] if p.back_address else []) + [p.host.name]
        entries.append((names, f"{pub[0]} {pub[1]}"))
    write(lab.known_hosts_path, access.known_hosts_text(entries, port))
    known = access.known_hosts_text(entries, port, both=True)  # a host's own: `ssh -p P` and plain names

    # per-host files
    try:
        base_hosts = Path("/etc/hosts").read_text()
    except OSError:
        base_hosts = "127.0.0.1 localhost\n"
    # every host names the others by the address it reaches them by: a dual-homed head's on network B
    hosts_text = render.etc_hosts(base_hosts, lab.name,
                                  [dataclasses.replace(p.host, address=p.back_address) if p.back_address else p.host
                                   for p in plans],
                                  (bplan.back_address, bplan.host.name) if bplan and bplan.back_address else None)
    try:
        base_bashrc = Path("/root/.bashrc").read_text()
    except OSError:
        base_bashrc = ""
    bashrc = render.bashrc(base_bashrc)
    python = host_python()
    need_openmpi_version = any(v.get("openmpi", "none") != "none" for v in (p.versions for p in plans))
    real_ompi = versions.openmpi_real_version(tools["mpirun"]) if need_openmpi_version else ""
    hide_exes = (versions.openmpi_names(render.path_dirs())
                 if any(p.versions.get("openmpi") == "none" for p in plans) else {})

    write(lab.init_path, render.init_script(python), 0o755)
    for p in every:
        write_host(lab, p, user_pub, user_key, known, hosts_text, bashrc, real_ompi, hide_exes, tools,
                   port=port, user=user, shared=state.get("shared"))

    # network: bridge(s), namespaces, veths in one `ip -batch`
    network.create(network.up_batch(lab.bridge, state["k"], hosts, jrec, v6=os.path.isdir("/proc/sys/net/ipv6")))

    # holders: per host, in parallel
    holders = parallel(lambda p: processes.start_holder(p, tools["unshare"]), every, workers=8)
    for rec, pid in zip(labstate.all_records(state), holders):
        rec["holder_pid"] = pid
    labstate.save(lab.state_path, state)

    # sshd per host (and the bastion), inside the holder's namespaces
    parallel(lambda p: processes.start_sshd(lab, p.host, wait=False), every, workers=8)
    deadline = time.monotonic() + 20
    for rec, p in zip(labstate.all_records(state), every):
        rec["sshd_pid"] = processes.wait_sshd_pid(lab, p.host, deadline)
    processes.await_reachable(lab, [p.host for p in every], deadline)

    jump = f"{user}@{jrec['address']}:{port}" if jrec else None
    write(lab.inventory_path, access.inventory_yaml(lab.name, state["hosts_subnet"], hosts, lab.key_path,
                                                    lab.known_hosts_path, user=user, port=port, jump=jump,
                                                    head_jump=head is not None))
    write(lab.ssh_config_path, access.ssh_client_config(
        lab.name, hosts, bplan.host if bplan else None, user=user, port=port, key=lab.key_path,
        known_hosts=lab.known_hosts_path, state_dir=lab.state_dir, head_jump=head is not None))
    state["status"] = "up"
    labstate.save(lab.state_path, state)


def write_host(lab: Lab, p: HostPlan, user_pub: str, user_key: str, known: str, hosts_text: str, bashrc: str,
               real_ompi: str, hide_exes: dict[str, list[str]], tools: dict, *,
               port: int = SSH_PORT, user: str = "root", shared: str | None = None) -> None:
    """Host p's dir: data/, tmp/, ssh/ (root's ~/.ssh), opt/ (--vary), home/ (--user), its
    /etc files, sshd_config and setup.sh."""
    d, h = p.dir, p.host
    (d / "data").mkdir()
    tmp = d / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    (d / "rootov").mkdir()
    (d / "cgroup").mkdir()
    write(d / "hccn.conf", render.hccn_conf(h.index))
    write(d / "hosts", hosts_text)
    write(d / "bashrc", bashrc)

    ssh = d / "ssh"
    ssh.mkdir(mode=0o700)
    if p.refuse_key:
        write(ssh / "authorized_keys", "# orch lab --refuse-key: the lab key is not accepted here\n", 0o600)
    else:
        write(ssh / "authorized_keys", user_pub + "\n", 0o600)
    write(ssh / "id_ed25519", user_key, 0o600)
    write(ssh / "id_ed25519.pub", user_pub + "\n", 0o644)
    write(ssh / "known_hosts", known, 0o644)
    write(ssh / "config", access.HOST_SSH_CONFIG, 0o600)

    opt = d / "opt"
    hide_dists = versions.install(p, opt, tools["mpirun"], real_ompi)
    has_site = any((opt / "site").iterdir())
    has_lib = any((opt / "lib").iterdir())
    write(ssh / "environment", render.host_path_env(has_site, has_lib), 0o600)
    if p.back_address:  # a jump host: OpenSSH's own MaxStartups (a connection storm meets the real limit)
        # a dual-homed head is a training host: the others reach its sshd on network B too
        also = (p.back_address,) if h.index != BASTION_INDEX else ()
        write(d / "sshd_config", render.sshd_config(h, d, port, BASTION_MAX_STARTUPS, also))
    else:
        write(d / "sshd_config", render.sshd_config(h, d, port))

    if user != "root":
        # the user's home (bound at /home/USER) with a ~/.ssh like root's; /data is theirs
        home = d / "home"
        home.mkdir(mode=0o755)
        shutil.copytree(ssh, home / ".ssh")
        for path in [home, *home.rglob("*"), d / "data"]:
            os.chown(path, USER_ID, USER_ID)

    write(d / "setup.sh", render.setup_script(p, state_dir=lab.state_dir, init_path=lab.init_path, user=user,
                                              hide_exes=hide_exes, hide_dists=hide_dists, shared=shared), 0o755)
