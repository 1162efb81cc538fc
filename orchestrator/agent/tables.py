"""The launch files that name hosts: OpenMPI's hostfile and HCCL's rank tables (1.0, 1.2, legacy).

Pure, stdlib, Python 3.8: the controller renders them through here for `orch plan` and `orch up`
(orchestrator/launchers builds the servers), and the run's head renders them on the cluster when
it replaces a lost host by a spare, so both write the same bytes for the same host set.

`servers`: the hosts that run ranks, in plan order, each a dict
    name, address (its cluster address: server_id / the hostfile's), slots,
    ranks: [[rank, device id], ...] in local-rank order,
    device_ips: {device id (str or int): ip}, super_device_ids: {device id: SDID} (1.2 only),
    super_pod_id (1.2 only)
"""

from __future__ import annotations

import json

from .layout import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, Dict, Mapping, Sequence

    Server = Dict[str, Any]   # (typing's Dict: python 3.8) one host as `servers` holds it (see the module's doc)


def _get(mapping: Mapping[Any, Any], device: int) -> Any:
    """A {device id: value} map read with a str or int key (JSON turns int keys into strings)."""
    if device in mapping:
        return mapping[device]
    return mapping[str(device)]


def server(name: str, address: str, slots: int, ranks: Sequence[Sequence[int]],
           device_ips: Mapping[int, str] | None = None, super_device_ids: Mapping[int, int] | None = None,
           super_pod_id: int | None = None) -> Server:
    return {"name": name, "address": address, "slots": slots, "ranks": [list(r) for r in ranks],
            "device_ips": dict(device_ips or {}), "super_device_ids": dict(super_device_ids or {}),
            "super_pod_id": super_pod_id}


def size(servers: Sequence[Server]) -> int:
    return sum(len(s["ranks"]) for s in servers)


def hostfile(servers: Sequence[Server], by_name: bool = False) -> str:
    """OpenMPI hostfile: `ADDRESS slots=N`, one host a line, in plan order (rank 0 on the first).
    `by_name`: host names instead (in a Slurm allocation, OpenMPI accepts only its node names)."""
    lines = ["# orch: %d hosts, %d ranks, in plan order (ranks are contiguous per host, by slot)"
             % (len(servers), size(servers))]
    lines.extend("%s slots=%d" % (s["name"] if by_name else s["address"], s["slots"]) for s in servers)
    return "\n".join(lines) + "\n"


def rank_table_v1(servers: Sequence[Server]) -> str:
    """HCCL rank table version 1.0 (hccl_tools.py's): every value a string."""
    out: list[Server] = []
    for s in servers:
        out.append({
            "server_id": s["address"],
            "device": [{"device_id": str(d), "device_ip": _get(s["device_ips"], d), "rank_id": str(r)}
                       for r, d in s["ranks"]],
            "host_nic_ip": "reserve",
        })
    return _dumps({"version": "1.0", "server_count": str(len(servers)), "server_list": out, "status": "completed"})


def rank_table_legacy(servers: Sequence[Server], aarch64: bool = False) -> str:
    """MindSpore 0.x rank table: one group, one instance per rank. board_id is 0x002f on aarch64
    (Kunpeng) hosts, as MindSpore's generator writes it there; para_plane_nic_name lists
    eth<device id> for every device id used."""
    instances = []
    for s in servers:
        for r, d in s["ranks"]:
            instances.append({"devices": [{"device_id": str(d), "device_ip": _get(s["device_ips"], d)}],
                              "rank_id": str(r), "server_id": s["address"]})
    nics = ["eth%d" % d for d in sorted({d for s in servers for _, d in s["ranks"]})]
    n = size(servers)
    table = {
        "board_id": "0x002f" if aarch64 else "0x0000",
        "chip_info": "910",
        "deploy_mode": "lab",
        "group_count": "1",
        "group_list": [{
            "device_num": str(n),
            "server_num": str(len(servers)),
            "group_name": "",
            "instance_count": str(n),
            "instance_list": instances,
        }],
        "para_plane_nic_location": "device",
        "para_plane_nic_name": nics,
        "para_plane_nic_num": str(len(nics)),
        "status": "completed",
    }
    return _dumps(table)


def rank_table_v12(servers: Sequence[Server]) -> str:
    """HCCL rank table version 1.2 (Atlas A3 SuperPoD), keys in the order of the HCCL user guide's
    example. host_ip only when the server's address is an IP (HCCL takes an IP there; the key is
    optional). The caller has checked every super_device_id and super_pod_id is there."""
    out: list[Server] = []
    pods: dict[Any, list[dict[str, str]]] = {}
    for s in servers:
        entry = {"server_id": s["address"]}
        if is_ip(s["address"]):
            entry["host_ip"] = s["address"]
        entry["device"] = [{"device_id": str(d), "super_device_id": str(_get(s["super_device_ids"], d)),
                            "device_ip": _get(s["device_ips"], d), "rank_id": str(r)} for r, d in s["ranks"]]
        out.append(entry)
        pods.setdefault(s["super_pod_id"], []).append({"server_id": s["address"]})
    return _dumps({"status": "completed", "version": "1.2", "server_count": str(len(servers)), "server_list": out,
                   "super_pod_list": [{"super_pod_id": str(p), "server_list": x} for p, x in pods.items()]})


def rank_table(version: str, servers: Sequence[Server], aarch64: bool = False) -> str:
    """The rank table in `version` ("1.0", "1.2" or "legacy")."""
    if version == "legacy":
        return rank_table_legacy(servers, aarch64)
    if version == "1.2":
        return rank_table_v12(servers)
    return rank_table_v1(servers)


def render(spec: Mapping[str, Any], servers: Sequence[Server]) -> dict[str, str]:
    """{file name: text} of the launch files `spec` names, for these servers. spec (the head's
    configuration, `tables`): {"hostfile": name or None, "by_name": bool, "rank_table": name or
    None, "version": ..., "aarch64": bool}."""
    out: dict[str, str] = {}
    if spec.get("hostfile"):
        out[spec["hostfile"]] = hostfile(servers, bool(spec.get("by_name")))
    if spec.get("rank_table"):
        out[spec["rank_table"]] = rank_table(spec.get("version") or "1.0", servers, bool(spec.get("aarch64")))
    return out


def is_ip(address: str) -> bool:
    import ipaddress   # here: ~1.4 ms of every supervisor's start otherwise, for the head's spares alone
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=4) + "\n"
