"""The lab's state file, <state dir>/lab.json: what `up` made (subnets, hosts, pids, mountpoints,
topology), read by every other command. Its records are plain dicts; a host's record becomes
a LabHost with host_from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ..errors import LabError
from .system import write
from .model import BASTION_INDEX, HOST_PREFIX, STATE_VERSION, SUBNET_PREFIX, LabHost
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


def all_records(state: dict) -> list[dict]:
    """Every host's record, the bastion's (if any) last."""
    return list(state.get("hosts", [])) + ([state["bastion"]] if state.get("bastion") else [])


def new(lab, hosts: list[LabHost], *, k: int, m: int, ssh_port: int, user: str, bastion: bool,
        vary: Mapping, refuse: set[int], created: list[str], python: str, now: float) -> dict:
    """The state of a lab `up` is making ("starting"): `lab` names things (a Lab), `k` and `m`
    are the third octets of its subnet and of the hosts' (the same without a bastion)."""
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
    if bastion:
        b = BASTION_INDEX
        state["bastion"] = dict(
            index=b, name=lab.bastion_name(), address=f"{SUBNET_PREFIX}.{k}.{HOST_PREFIX + b}",
            netns=lab.netns_name(b), veth=lab.veth_name(b), holder_pid=None, sshd_pid=None,
            versions={}, refuse_key=False,
            # its NIC on the hosts' network, which is the lab's second, reserved subnet
            back_address=f"{SUBNET_PREFIX}.{m}.{HOST_PREFIX + b}", back_veth=lab.back_veth_name(),
            k=m, subnet=f"{SUBNET_PREFIX}.{m}.0/24", bridge=lab.hosts_bridge_name,
        )
    return state
