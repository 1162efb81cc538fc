"""How people and orch reach a lab, as pure text: the inventory, known_hosts, the OpenSSH
client config, the system ssh argv, and the reachability probe run from the jump host. No I/O.

The topologies (`orch lab up N --ssh-port P --user NAME --bastion | --dual-homed-head`) show here:

--ssh-port P  every sshd (hosts and bastion) listens on P. The lab's known_hosts names every
              host as ``[address]:P`` / ``[name]:P`` (OpenSSH's form for a port other than 22);
              a host's own ~/.ssh/known_hosts has both forms and its ~/.ssh/config sets no port
              (orch passes it, e.g. ``-mca plm_rsh_args "-p P"`` for mpirun).
--user NAME   an ordinary user NAME (uid = gid = USER_ID) on every host, from per-host copies of
              /etc/passwd and /etc/group bound over the real ones inside the host (the machine's
              files are only read; render.passwd_with_user). Its home /home/NAME (per host; /home
              is an overlay like /root) holds the lab key, known_hosts, config and environment as
              root's ~/.ssh does; /data is the user's. sshd reads no /etc/shadow entry for it (none
              needed with UsePAM no: the password field is ``*``, not a locked ``!``). Root login
              still works.
--bastion     the hosts sit on a second bridge with no address of this machine and an
              ``unreachable`` route to their subnet here (a connect fails at once, nothing leaves
              the machine); the only way in is host 0, the bastion: two NICs (this machine's
              bridge and the hosts' bridge), its own sshd (MaxStartups 10:30:100, LogLevel
              VERBOSE), IP forwarding off. The inventory gets ``jump: USER@BASTION:PORT``, and
              <state dir>/ssh_config names every host by its name with ProxyJump to the bastion.
--dual-homed-head
              the same two networks, but the jump host is host 1, a training host (a launch
              host that is also the bastion): network A is this machine's bridge, where host 1
              alone has an address (eth0, 198.18.K.11); network B, the training network, is
              the hosts' bridge (198.18.M.0/24, nothing of this machine's on it, an
              ``unreachable`` route to it here), with host 1's second NIC (eth1, 198.18.M.11)
              and hosts 2..N (eth0, 198.18.M.(10+i)). Host 1's sshd listens on both addresses
              (MaxStartups 10:30:100, as the bastion's), IP forwarding off, and every host's
              /etc/hosts names host 1 by its network-B address. The inventory lists host 1 by
              its network-A address with no ``jump`` and no ``mpi_address`` (how the others
              reach it is for orch to find out), and hosts 2..N with ``jump: USER@HOST1:PORT``;
              ssh_config gives hosts 2..N ProxyJump to host 1's alias.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Iterable, Sequence

from .model import SLOTS, SSH_PORT, LabHost

# plain YAML scalars that are not strings (YAML 1.1, what PyYAML reads)
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}

# What a lab host's ~/.ssh/config says (port deliberately absent: orch passes it).
HOST_SSH_CONFIG = ("Host *\n    BatchMode yes\n    StrictHostKeyChecking yes\n"
                   "    UserKnownHostsFile ~/.ssh/known_hosts\n    IdentityFile ~/.ssh/id_ed25519\n"
                   "    ConnectTimeout 10\n")


def yaml_str(value: str) -> str:
    """value as a YAML scalar: plain where that reads back as the same string, else quoted."""
    if re.fullmatch(r"[A-Za-z_/][A-Za-z0-9_./-]*", value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


def inventory_yaml(name: str, subnet: str, hosts: Sequence[LabHost], key: Path, known_hosts: Path, *,
                   user: str = "root", port: int = SSH_PORT, jump: str | None = None,
                   head_jump: bool = False) -> str:
    """`jump` (USER@ADDRESS:PORT of the jump host) goes into the defaults (a bastion: every host
    is behind it) or, with `head_jump` (a dual-homed head, hosts[0]), onto every host but the
    first, which is listed by the address this machine reaches it by, without mpi_address."""
    extra = f", jump: {yaml_str(jump)}" if jump and not head_jump else ""
    lines = [
        f"# orch lab {name!r}: {len(hosts)} simulated hosts on {subnet}; made by `orch lab up`,",
        "# removed by `orch lab down`. Usable unchanged as `inventory:` in a cluster.yaml.",
    ]
    if head_jump:
        front = hosts[0].address.rsplit(".", 1)[0] + ".0/24"
        lines += [f"# {hosts[0].name} is also on this machine's network, {front}, and listed by its address there:",
                  "# the only host this machine reaches, and the others' jump host; they reach it on",
                  f"# {subnet} only (no mpi_address: which address that is, is for orch to find out)."]
    lines += [
        f"defaults: {{user: {yaml_str(user)}, port: {port}, identity_file: {key}, "
        f"known_hosts: {known_hosts}, slots: {SLOTS}{extra}}}",
        "hosts:",
    ]
    for n, h in enumerate(hosts):
        via = f", jump: {yaml_str(jump)}" if jump and head_jump and n else ""
        lines.append(f"  - {{address: {h.address}, name: {h.name}{via}}}")
    return "\n".join(lines) + "\n"


def host_patterns(names: Iterable[str], port: int) -> list[str]:
    """known_hosts patterns for a host's addresses/names: as is on port 22, else ``[x]:port``."""
    return [n if port == 22 else f"[{n}]:{port}" for n in names]


def known_hosts_text(entries: Sequence[tuple[Sequence[str], str]], port: int, *, both: bool = False) -> str:
    """entries: (names and addresses, "keytype base64"). With `both`, a port other than 22 also
    lists the plain names (what a host's own known_hosts has)."""
    out = []
    for names, key in entries:
        pats = host_patterns(names, port)
        if both and port != 22:
            pats += list(names)
        out.append(f"{','.join(pats)} {key}\n")
    return "".join(out)


def _cfg_value(value: str) -> str:
    return f'"{value}"' if re.search(r'\s', value) else value


def ssh_client_config(lab: str, hosts: Sequence, bastion, *, user: str, port: int, key: Path,
                      known_hosts: Path, state_dir: Path, head_jump: bool = False) -> str:
    """An OpenSSH client config (ssh -F FILE ALIAS): every host (and the bastion) by its lab
    name; with a bastion, every host has ProxyJump to the bastion's alias; with `head_jump` (a
    dual-homed head), every host but the first has ProxyJump to the first's. `hosts`/`bastion`
    are LabHost records."""
    lines = [
        f"# orch lab {lab!r}: OpenSSH client config; made by `orch lab up`, removed by `orch lab down`.",
        f"# e.g.: ssh -F {_cfg_value(str(state_dir / 'ssh_config'))} {hosts[0].name} hostname",
    ]

    def block(alias: str, address: str, jump: str | None) -> None:
        lines.extend([
            "",
            f"Host {alias}",
            f"    HostName {address}",
            f"    User {user}",
            f"    Port {port}",
            f"    IdentityFile {_cfg_value(str(key))}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {_cfg_value(str(known_hosts))}",
            "    StrictHostKeyChecking yes",
            "    BatchMode yes",
            "    ConnectTimeout 10",
        ])
        if jump:
            lines.append(f"    ProxyJump {jump}")

    if bastion is not None:
        block(bastion.name, bastion.address, None)
    for n, h in enumerate(hosts):
        jump = bastion.name if bastion is not None else hosts[0].name if head_jump and n else None
        block(h.name, h.address, jump)
    return "\n".join(lines) + "\n"


def ssh_argv(address: str, *, key: Path, known_hosts: Path, port: int, user: str = "root",
             bastion: str | None = None, command: str | None = None, connect_timeout: int = 5) -> list[str]:
    """The system ssh client's argv to reach `address` as `user` with the lab's key and port (reads
    nothing in ~/.ssh); through the `bastion` address, as the same user, if given."""
    opts = [
        "-i", str(key),
        "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-o", "BatchMode=yes",
        "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes", "-o", f"ConnectTimeout={connect_timeout}",
        "-o", "LogLevel=ERROR", "-p", str(port),
    ]
    argv = ["ssh", "-F", "/dev/null", *opts]
    if bastion:
        jump = ["ssh", "-F", "/dev/null", *opts, "-W", "[%h]:%p", f"{user}@{bastion}"]
        argv += ["-o", "ProxyCommand=" + shlex.join(jump)]
    argv.append(f"{user}@{address}")
    if command is not None:
        argv.append(command)
    return argv


# Run with this machine's python inside the jump host's network namespace (nsenter --net):
# argv = deadline-seconds ADDR:PORT...; exits 0 once every target accepts a TCP connection,
# else 1 naming those that did not. One process for every host behind the jump host.
REACH_PROBE = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
left = [a.rsplit(":", 1) for a in sys.argv[2:]]
err = {}
while left:
    nxt = []
    for addr, port in left:
        try:
            socket.create_connection((addr, int(port)), timeout=2).close()
        except OSError as exc:
            err[addr] = str(exc)
            nxt.append((addr, port))
    left = nxt
    if left:
        if time.monotonic() > deadline:
            print("; ".join(f"{a}:{p}: {err[a]}" for a, p in left))
            sys.exit(1)
        time.sleep(0.02)
"""
