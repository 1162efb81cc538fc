"""The lab's extra topologies (`orch lab up N --ssh-port P --user NAME --bastion`): pure text
helpers for orchestrator/lab.py, which does the namespaces, mounts and processes.

--ssh-port P  every sshd (hosts and bastion) listens on P. The lab's known_hosts names every
              host as ``[address]:P`` / ``[name]:P`` (OpenSSH's form for a port other than 22);
              a host's own ~/.ssh/known_hosts has both forms and its ~/.ssh/config sets no port
              (orch passes it, e.g. ``-mca plm_rsh_args "-p P"`` for mpirun).
--user NAME   an ordinary user NAME (uid = gid = USER_ID) on every host, from per-host copies of
              /etc/passwd and /etc/group bound over the real ones inside the host (the machine's
              files are only read). Its home /home/NAME (per host; /home is an overlay like /root)
              holds the lab key, known_hosts, config and environment as root's ~/.ssh does; /data
              is the user's. sshd reads no /etc/shadow entry for it (none needed with UsePAM no:
              the password field is ``*``, not a locked ``!``). Root login still works.
--bastion     the hosts sit on a second bridge with no address of this machine and an
              ``unreachable`` route to their subnet here (a connect fails at once, nothing leaves
              the machine); the only way in is host 0, the bastion: two NICs (this machine's
              bridge and the hosts' bridge), its own sshd (MaxStartups 10:30:100, LogLevel
              VERBOSE), IP forwarding off. The inventory gets ``jump: USER@BASTION:PORT``, and
              <state dir>/ssh_config names every host by its name with ProxyJump to the bastion.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from .errors import LabError

USER_ID = 4300              # uid and gid of the --user account on every host
BASTION_INDEX = 0           # Lab.host(0), Lab.exec(0, ...), `orch lab sshd stop 0`: the bastion
BASTION_MAX_STARTUPS = "10:30:100"  # OpenSSH's default: a connection storm meets the real limit
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
# plain YAML scalars that are not strings (YAML 1.1, what PyYAML reads)
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}

# What a lab host's ~/.ssh/config says (port deliberately absent: orch passes it).
HOST_SSH_CONFIG = ("Host *\n    BatchMode yes\n    StrictHostKeyChecking yes\n"
                   "    UserKnownHostsFile ~/.ssh/known_hosts\n    IdentityFile ~/.ssh/id_ed25519\n"
                   "    ConnectTimeout 10\n")


def validate_port(port) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise LabError(f"bad ssh port {port!r}", hint="--ssh-port takes 1..65535, e.g. 2222")
    return port


def validate_user(user) -> str:
    if not isinstance(user, str) or not USER_RE.fullmatch(user):
        raise LabError(f"bad lab user name {user!r}",
                       hint="a user name is a-z, 0-9, _ and -, starting with a letter or _, e.g. --user train")
    return user


def yaml_str(value: str) -> str:
    """value as a YAML scalar: plain where that reads back as the same string, else quoted."""
    if re.fullmatch(r"[A-Za-z_/][A-Za-z0-9_./-]*", value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)


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
                      known_hosts: Path, state_dir: Path) -> str:
    """An OpenSSH client config (ssh -F FILE ALIAS): every host (and the bastion) by its lab
    name; with a bastion, every host has ProxyJump to the bastion's alias. `hosts`/`bastion`
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
    for h in hosts:
        block(h.name, h.address, bastion.name if bastion is not None else None)
    return "\n".join(lines) + "\n"


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


# Run with this machine's python inside the bastion's network namespace (nsenter --net):
# argv = deadline-seconds ADDR:PORT...; exits 0 once every target accepts a TCP connection,
# else 1 naming those that did not. One process for every host behind the bastion.
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
