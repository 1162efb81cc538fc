"""The lab's network on this machine: a free 198.18.K.0/24, the bridge(s), namespaces and veths
(one `ip -batch` to make, one to remove), a host's link up/down, and waiting until every
sshd port answers (from here, or from the jump host's namespace for hosts behind it)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import LabError
from . import state as labstate
from .access import REACH_PROBE
from .model import NETNS_DIR, SUBNET_PREFIX, LabHost, subnet_octet
from .system import listdir, run


def pick_subnet(root: Path, name: str, also_used: Iterable[int] = (), salt: str = "") -> int:
    """A free third octet: no other lab's (its own subnet or its hosts' behind a bastion or a
    dual-homed head), no address or route of this machine in 198.18.K.0/24. Call it under
    mounts.locked(root)."""
    used: set[int] = set(also_used)
    for other in root.iterdir():
        if other.name == name:
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            used |= labstate.octets(json.loads((other / "lab.json").read_text()))
    res = run(["ip", "-o", "-4", "addr", "show"], check=False, timeout=10)
    for m in re.finditer(r"inet\s+198\.18\.(\d+)\.\d+", res.stdout):
        used.add(int(m.group(1)))
    res = run(["ip", "-o", "-4", "route", "show", "table", "all"], check=False, timeout=10)
    for m in re.finditer(r"(?:^|\s)198\.18\.(\d+)\.\d+", res.stdout):
        used.add(int(m.group(1)))
    start = subnet_octet(name + salt)
    for step in range(250):
        k = (start - 1 + step) % 250 + 1
        if k not in used:
            return k
    raise LabError("every 198.18.K.0/24 subnet is taken by other labs", hint="orch lab down --name OTHER")


def up_batch(bridge: str, k: int, hosts: Sequence[LabHost], jump: dict | None = None, *,
             v6: bool = False) -> list[str]:
    """The `ip -batch` lines making the lab's network: this machine's bridge (198.18.K.1), each
    host's namespace and veth on it. With a `jump` host (state.jump: the bastion's record, or
    host 1's with --dual-homed-head) the hosts are on the jump host's bridge instead (network
    B), with an unreachable route to them here, and the jump host alone has two NICs: eth0 on
    this machine's bridge, eth1 on the hosts'. `v6`: this machine has IPv6 (then the hosts'
    network gets no link-local addresses on this machine's side)."""
    lines = [
        f"link add name {bridge} type bridge forward_delay 0",
        f"addr add {SUBNET_PREFIX}.{k}.1/24 dev {bridge}",
        f"link set {bridge} up",
    ]
    hosts_bridge = bridge

    def no_v6(dev: str) -> list[str]:
        return [f"link set {dev} addrgenmode none"] if v6 and jump is not None else []

    if jump:
        hosts_bridge = jump["bridge"]
        netns, veth, back = jump["netns"], jump["veth"], jump["back_veth"]
        lines += [f"link add name {hosts_bridge} type bridge forward_delay 0", *no_v6(hosts_bridge),
                  f"link set {hosts_bridge} up",
                  # no way from here to the hosts: a connect fails at once, nothing leaves the machine
                  f"route add unreachable {jump['subnet']}",
                  f"netns add {netns}",
                  f"link add {veth} type veth peer name eth0 netns {netns}",
                  f"link set {veth} master {bridge} up",
                  f"link add {back} type veth peer name eth1 netns {netns}",
                  *no_v6(back),
                  f"link set {back} master {hosts_bridge} up"]
    for h in hosts:
        if jump and h.index == jump["index"]:  # a dual-homed head: made above
            continue
        lines += [
            f"netns add {h.netns}",
            f"link add {h.veth} type veth peer name eth0 netns {h.netns}",
            *no_v6(h.veth),
            f"link set {h.veth} master {hosts_bridge} up",
        ]
    return lines


def create(lines: Sequence[str]) -> None:
    res = run(["ip", "-batch", "-"], input="\n".join(lines) + "\n", check=False, timeout=120)
    if res.returncode != 0:
        raise LabError(
            f"could not create the lab network: {res.stderr.strip() or res.stdout.strip()}",
            hint="the lab needs network namespaces, veth and bridge support (CAP_NET_ADMIN, a kernel with "
                 "CONFIG_NET_NS/CONFIG_VETH/CONFIG_BRIDGE)",
        )


def remove(name: str, bridges: Sequence[str], route: str | None) -> bool:
    """Delete every veth and namespace of lab `name` (a jump host's back veth, -0b or -1b, too), its
    `bridges` and the unreachable `route` to its hosts' subnet; True if there was any. Raises naming
    what is left."""
    vpat = re.compile(rf"ol{re.escape(name)}-\d+b?")
    npat = re.compile(rf"olab-{re.escape(name)}-\d+")
    links = [x for x in listdir("/sys/class/net") if vpat.fullmatch(x)]
    nss = [x for x in listdir(NETNS_DIR) if npat.fullmatch(x)]
    bridges = [b for b in bridges if os.path.exists(f"/sys/class/net/{b}")]
    lines = [f"link del {v}" for v in links]
    lines += [f"link del {b}" for b in bridges]
    lines += [f"netns del {ns}" for ns in nss]

    def route_left() -> bool:
        if not route:
            return False
        return bool(run(["ip", "-4", "route", "show", "type", "unreachable", route],
                        check=False, timeout=10).stdout.strip())

    if route_left():
        lines.append(f"route del unreachable {route}")
    if not lines:
        return False
    res = run(["ip", "-force", "-batch", "-"], input="\n".join(lines) + "\n", check=False, timeout=120)
    left = ([v for v in links + bridges if os.path.exists(f"/sys/class/net/{v}")]
            + [n for n in nss if os.path.exists(f"{NETNS_DIR}/{n}")])
    if route_left():
        left.append(f"route unreachable {route}")
    if left:
        raise LabError(f"lab {name!r}: could not remove {', '.join(left)}: {res.stderr.strip()[-300:]}")
    return True


def set_link(h: LabHost, up: bool) -> None:
    run(["ip", "link", "set", h.veth, "up" if up else "down"], what=f"{h.name}: ip link set {h.veth}")


def link_up(veth: str) -> bool:
    try:
        return int(Path(f"/sys/class/net/{veth}/flags").read_text(), 16) & 0x1 == 1
    except (OSError, ValueError):
        return False


def await_reachable(hosts: Sequence[LabHost], port: int, jump: dict | None, deadline: float,
                    lab: str) -> None:
    """Until every host's sshd port accepts a connection. The pid file is written after listen();
    one connect proves the path through the bridge: from here, or for hosts behind a `jump` host
    (state.jump: the bastion, a dual-homed head) from its network namespace (one probe process
    for all of them)."""
    behind = [h for h in hosts if jump and h.index != jump["index"]]
    for h in hosts:
        if h in behind:
            continue
        while True:
            try:
                with socket.create_connection((h.address, port), timeout=2):
                    break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise LabError(f"{h.name}: sshd runs but {h.address}:{port} is unreachable: {exc}",
                                   hint=f"check the link: orch lab status --name {lab}") from None
                time.sleep(0.02)
    if behind:
        assert jump is not None  # only hosts behind a jump host are out of this machine's reach
        left = max(deadline - time.monotonic(), 0.5)
        res = run(["nsenter", f"--net={NETNS_DIR}/{jump['netns']}", sys.executable, "-I", "-S", "-c",
                   REACH_PROBE, f"{left:.2f}", *(f"{h.address}:{port}" for h in behind)],
                  check=False, timeout=left + 20, what=f"reaching the hosts from {jump['name']}")
        if res.returncode != 0:
            raise LabError(f"sshd runs but the jump host {jump['name']} cannot reach: "
                           f"{(res.stdout or res.stderr).strip()[-500:]}",
                           hint=f"check the links: orch lab status --name {lab}")
