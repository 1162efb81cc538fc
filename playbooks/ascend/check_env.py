"""Checks that a rank-table launch gave THIS process a consistent environment.

No NPU is needed: what is tested is the launch contract. Exits non-zero, loudly,
on any mismatch between DEVICE_ID / RANK_ID / RANK_SIZE / DEVICE_NUM, the rank
table (RANK_TABLE_FILE, v1.0 or legacy) and this host's /etc/hccn.conf.
"""

import json
import os
import socket
import subprocess
import sys


def fail(msg):
    print(f"ENV CHECK FAILED: {msg}", flush=True)
    sys.exit(1)


def local_addresses():
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        return {line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3}
    except OSError:
        return {socket.gethostbyname(socket.gethostname())}


def hccn():
    ips = {}
    try:
        for line in open("/etc/hccn.conf"):
            k, _, v = line.strip().partition("=")
            if k.startswith("address_"):
                ips[int(k[len("address_"):])] = v.strip()
    except OSError as exc:
        fail(f"cannot read /etc/hccn.conf: {exc}")
    return ips


def entries(table):
    """(server_id, device_id, device_ip, rank_id) for every device, either format."""
    if "server_list" in table:  # v1.0
        for s in table["server_list"]:
            for d in s["device"]:
                yield s["server_id"], d["device_id"], d["device_ip"], d["rank_id"]
    else:  # legacy group_list
        for g in table["group_list"]:
            for inst in g["instance_list"]:
                for d in inst["devices"]:
                    yield inst["server_id"], d["device_id"], d["device_ip"], inst["rank_id"]


def main():
    env = os.environ
    for name in ("DEVICE_ID", "RANK_ID", "RANK_SIZE", "DEVICE_NUM", "RANK_TABLE_FILE"):
        if name not in env:
            fail(f"{name} is not set")
    path = env.get("MINDSPORE_HCCL_CONFIG_PATH") or env["RANK_TABLE_FILE"]
    table = json.load(open(path))
    rows = list(entries(table))
    mine = [r for r in rows if r[3] == env["RANK_ID"]]
    if len(mine) != 1:
        fail(f"rank {env['RANK_ID']} appears {len(mine)} times in {path}")
    server_id, device_id, device_ip, _ = mine[0]
    if device_id != env["DEVICE_ID"]:
        fail(f"rank table says device {device_id}, DEVICE_ID={env['DEVICE_ID']}")
    if str(len(rows)) != env["RANK_SIZE"]:
        fail(f"rank table has {len(rows)} ranks, RANK_SIZE={env['RANK_SIZE']}")
    here = [r for r in rows if r[0] == server_id]
    if str(len(here)) != env["DEVICE_NUM"]:
        fail(f"{len(here)} devices on server {server_id}, DEVICE_NUM={env['DEVICE_NUM']}")
    if server_id not in local_addresses():
        fail(f"server_id {server_id} is not an address of this host")
    conf = hccn().get(int(device_id))
    if conf != device_ip:
        fail(f"device {device_id}: rank table device_ip {device_ip}, /etc/hccn.conf has {conf}")
    print(f"env ok: rank {env['RANK_ID']}/{env['RANK_SIZE']} device {device_id} ip {device_ip} "
          f"server {server_id} host {socket.gethostname()}", flush=True)


if __name__ == "__main__":
    main()
