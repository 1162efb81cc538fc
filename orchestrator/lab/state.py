"""The lab's state file, <state dir>/lab.json: what `up` made (subnets, hosts, pids, mountpoints,
topology), read by every other command. Its records are plain dicts; a host's record becomes
a LabHost with host_from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ..errors import LabError
from .system import write
from .model import BASTION_INDEX, HEAD_INDEX, HOST_PREFIX, STATE_VERSION, SUBNET_PREFIX, LabHost
from .versions import host_versions


def read(path: Path, name: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LabError(
            f"no lab named {name!r} (no {path})",
            hint=f"start one with: orch lab up N --name {name}",
        ) from None
    except (OSError, ValueError) as exc:
        raise LabError(f"cannot read {path}: {exc}", hint=f"orch lab down --name {name}") from None


def read_or_empty(path: Path) -> dict:
    """The state, or {} when there is none or it is unreadable (what `down` works from)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save(path: Path, state: dict) -> None:
    write(path, json.dumps(state, indent=1, sort_keys=True) + "\n")


def host_from(rec: dict) -> LabHost:
    return LabHost(rec["index"], rec["name"], rec["address"], rec["netns"], rec["veth"])


def record(state: dict, i: int, lab: str) -> dict:
    """Host i's record in `state` (mutable; i = 0: the bastion's)."""
    hosts = state["hosts"]
    if isinstance(i, int) and not isinstance(i, bool):
        if 1 <= i <= len(hosts):
            return hosts[i - 1]
        if i == BASTION_INDEX and state.get("bastion"):
            return state["bastion"]
    hint = f"hosts are 1..{len(hosts)}" + (" (0: the bastion)" if state.get("bastion") else "")
    raise LabError(f"lab {lab!r} has no host {i!r}", hint=hint)


def jump(state: dict) -> dict | None:
    """The host the lab is entered through, or None when this machine reaches every host: the
    bastion's record (--bastion), or a copy of host 1's with the hosts' network in it
    (--dual-homed-head). Either way it has the host's keys (index, name, address on this
    machine's bridge, netns, veth), ``back_address``/``back_veth`` (its NIC on the hosts'
    network) and that network's ``k``, ``subnet`` and ``bridge``."""
    if state.get("bastion"):
        return state["bastion"]
    net = state.get("dual_homed_head")
    if net:
        return {**state["hosts"][net["index"] - 1], **net}
    return None


def octets(state: dict) -> set[int]:
    """The third octets of every 198.18.K.0/24 the lab holds (this machine's bridge's, and the
    hosts' network behind a jump host)."""
    out = {int(state["k"])}
    j = jump(state)
    if j:
        out.add(int(j["k"]))
    return out


def all_records(state: dict) -> list[dict]:
    """Every host's record, the bastion's (if any) last."""
    return list(state.get("hosts", [])) + ([state["bastion"]] if state.get("bastion") else [])


def new(lab, hosts: list[LabHost], *, k: int, m: int, ssh_port: int, user: str, bastion: bool,
        vary: Mapping, refuse: set[int], created: list[str], python: str, now: float,
        dual_homed_head: bool = False) -> dict:
    """The state of a lab `up` is making ("starting"): `lab` names things (a Lab), `k` and `m`
    are the third octets of its subnet and of the hosts' (the same without a bastion or a
    dual-homed head). `hosts` have their addresses: with `dual_homed_head`, host 1's on this
    machine's subnet (its second one, on the hosts', is made here)."""
    state = {
        "version": STATE_VERSION,
        "name": lab.name,
        "status": "starting",
        "k": k,
        "subnet": f"{SUBNET_PREFIX}.{k}.0/24",
        "gateway": f"{SUBNET_PREFIX}.{k}.1",
        "bridge": lab.bridge,
        "hosts_subnet": f"{SUBNET_PREFIX}.{m}.0/24",
        "ssh_port": ssh_port,
        "user": user,
        "bastion": None,
        "dual_homed_head": None,
        "created_at": now,
        "python": python,
        "mountpoints_created": created,
        "hosts": [
            dict(index=h.index, name=h.name, address=h.address, netns=h.netns, veth=h.veth,
                 holder_pid=None, sshd_pid=None, versions=host_versions(vary, h.index),
                 refuse_key=h.index in refuse)
            for h in hosts
        ],
    }
    # the hosts' network behind the jump host: the lab's second, reserved subnet
    hosts_net = dict(k=m, subnet=f"{SUBNET_PREFIX}.{m}.0/24", bridge=lab.hosts_bridge_name)
    if bastion:
        b = BASTION_INDEX
        state["bastion"] = dict(
            index=b, name=lab.bastion_name(), address=f"{SUBNET_PREFIX}.{k}.{HOST_PREFIX + b}",
            netns=lab.netns_name(b), veth=lab.veth_name(b), holder_pid=None, sshd_pid=None,
            versions={}, refuse_key=False,
            # its NIC on the hosts' network
            back_address=f"{SUBNET_PREFIX}.{m}.{HOST_PREFIX + b}", back_veth=lab.back_veth_name(b),
            **hosts_net,
        )
    elif dual_homed_head:
        head = state["hosts"][HEAD_INDEX - 1]
        head.update(back_address=f"{SUBNET_PREFIX}.{m}.{HOST_PREFIX + HEAD_INDEX}",
                    back_veth=lab.back_veth_name(HEAD_INDEX))
        state["dual_homed_head"] = dict(index=HEAD_INDEX, **hosts_net)
    return state
