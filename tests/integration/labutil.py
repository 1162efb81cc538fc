"""Helpers for integration tests: cluster files that point at a lab's inventory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from orchestrator.spec import Cluster, load_cluster


def write_cluster(lab, tmp_path: Path, *, name: str = "cluster.yaml", ssh: dict | None = None,
                  checks: dict | None = None, defaults: dict | None = None, hosts: int | None = None,
                  **job) -> Path:
    """A cluster.yaml using the lab's inventory; `job` keys override the job defaults.
    With `defaults` (host keys such as slots/devices) or `hosts` (only the first N), the
    inventory is inlined with those changes; otherwise it is used unchanged, by path."""
    inventory: str | dict = str(lab.inventory_path)
    if defaults or hosts:
        inv = yaml.safe_load(Path(lab.inventory_path).read_text())
        inv["defaults"] = {**inv.get("defaults", {}), **(defaults or {})}
        if hosts:
            inv["hosts"] = inv["hosts"][:hosts]
        inventory = inv
    doc = {
        "inventory": inventory,
        "ssh": {"connect_timeout": 5, "command_timeout": 60, "retries": 2, **(ssh or {})},
        "job": {"workdir": "/data/job", "command": "hostname", **job},
    }
    if checks:
        doc["checks"] = checks
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def lab_cluster(lab, tmp_path: Path, **kw) -> Cluster:
    return load_cluster(write_cluster(lab, tmp_path, **kw))


def leftovers(run_id: str, comm: str | None = None) -> list[str]:
    """Live processes anywhere on this machine (so on every lab host) that belong to the run;
    with `comm`, only those whose command name is `comm` (say the ranks' `sleep`, leaving out
    the helpers a run starts and ends while it runs)."""
    needle = f"ORCH_RUN_ID={run_id}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, state = stat.split("(", 1)[1].rsplit(")", 1)[0], stat.rsplit(")", 1)[1].split()[0]
        if needle in env and state != "Z" and comm in (None, name):
            out.append(pid)
    return out


def wait_until(pred, timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Poll `pred` until it is true or `timeout` seconds pass; says which."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False
