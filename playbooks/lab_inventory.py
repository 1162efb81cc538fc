"""Derive an inventory with other slots/devices from an `orch lab up` inventory.

`orch lab up N` gives every host 2 slots (devices 0-1). The Ascend and GPU playbooks
need 8 devices per host, devices [4,8) or devices [2,3]: this writes a copy of the lab's
inventory with those host defaults (and, with --hosts, only the first hosts), next to
the lab's own (so `orch lab down` removes it with the lab):

    orch lab up 2
    python3 playbooks/lab_inventory.py ascend-1x8.yaml --hosts 1 --slots 8
    # -> /var/tmp/orch-lab/lab/ascend-1x8.yaml

--lab NAME picks another lab (default "lab"; root $ORCH_LAB_ROOT, default /var/tmp/orch-lab).
OUT may also be a path with a "/" in it, used as is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml


def derive(inventory: dict, *, hosts: int | None = None, slots: int | None = None,
           devices: list[int] | None = None) -> dict:
    inv = dict(inventory)
    defaults = dict(inv.get("defaults") or {})
    if devices is not None:
        defaults["devices"] = devices
        defaults["slots"] = len(devices) if slots is None else slots
    elif slots is not None:
        defaults["slots"] = slots
    inv["defaults"] = defaults
    if hosts:
        if hosts > len(inv["hosts"]):
            raise SystemExit(f"the lab has {len(inv['hosts'])} host(s), not {hosts}: `orch lab up {hosts}`")
        inv["hosts"] = inv["hosts"][:hosts]
    return inv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="file name in the lab's directory, or a path containing '/'")
    ap.add_argument("--lab", default="lab", help="lab name (default: lab)")
    ap.add_argument("--hosts", type=int, help="keep only the first N hosts")
    ap.add_argument("--slots", type=int, help="ranks per host")
    ap.add_argument("--devices", help="physical device ids per host, e.g. 4,5,6,7 (slots = their count)")
    a = ap.parse_args(argv)
    lab_dir = Path(os.environ.get("ORCH_LAB_ROOT", "/var/tmp/orch-lab")) / a.lab
    src = lab_dir / "inventory.yaml"
    if not src.is_file():
        print(f"no lab inventory at {src}: run `orch lab up N --name {a.lab}` first", file=sys.stderr)
        return 2
    devices = [int(d) for d in a.devices.split(",")] if a.devices else None
    inv = derive(yaml.safe_load(src.read_text()), hosts=a.hosts, slots=a.slots, devices=devices)
    out = Path(a.out) if "/" in a.out else lab_dir / a.out
    out.write_text(f"# derived from {src} by playbooks/lab_inventory.py {' '.join(argv or sys.argv[1:])}\n"
                   + yaml.safe_dump(inv, sort_keys=False, default_flow_style=None))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
