"""Helpers shared by the fault scenarios: run the real CLI, read run records, find processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.integration.labutil import leftovers, wait_until  # noqa: F401 - re-exported for the fault tests

REPO = Path(__file__).resolve().parents[2]
ORCH = [sys.executable, "-m", "orchestrator.cli"]


def orch(*args, cwd, timeout: float = 180, check_rc: int | None = None, env: dict | None = None):
    """Run `orch ARGS` as a user would (a fresh process, in `cwd`)."""
    res = subprocess.run([*ORCH, *map(str, args)], cwd=cwd, capture_output=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    if check_rc is not None:
        assert res.returncode == check_rc, (res.returncode, res.stdout.decode(errors="replace")[-3000:],
                                            res.stderr.decode(errors="replace")[-3000:])
    return res


def spawn_orch(*args, cwd, **kw) -> subprocess.Popen:
    return subprocess.Popen([*ORCH, *map(str, args)], cwd=cwd, stdout=kw.pop("stdout", subprocess.PIPE),
                            stderr=kw.pop("stderr", subprocess.PIPE), **kw)


def runs_dir(cwd: Path) -> Path:
    return Path(cwd) / ".orch" / "runs"


def run_ids(cwd: Path) -> list[str]:
    d = runs_dir(cwd)
    return sorted(p.name for p in d.iterdir() if (p / "run.json").is_file()) if d.is_dir() else []


def run_record(cwd: Path, run_id: str | None = None) -> dict:
    ids = run_ids(cwd)
    chosen = run_id if run_id is not None else ids[-1]
    return json.loads((runs_dir(cwd) / chosen / "run.json").read_text())





def running(cwd: Path) -> bool:
    """The latest run of `cwd` has started its processes."""
    try:
        return run_record(cwd).get("state") == "running" and bool(run_record(cwd).get("procs"))
    except (IndexError, OSError, ValueError):
        return False


def write_cluster(lab, tmp_path: Path, *, name: str = "cluster.yaml", ssh: dict | None = None,
                  checks: dict | None = None, inventory: dict | None = None, hosts: int | None = None,
                  **job) -> Path:
    """A cluster.yaml over the lab's hosts (inline inventory: the first `hosts` hosts);
    `inventory` keys and `job` keys override."""
    inv = yaml.safe_load(Path(lab.inventory_path).read_text())
    if hosts:
        inv["hosts"] = inv["hosts"][:hosts]
    inv.update(inventory or {})
    doc = {
        "inventory": inv,
        "ssh": {"connect_timeout": 2, "command_timeout": 20, "retries": 2, **(ssh or {})},
        "job": {"workdir": "/data/fx", "command": "hostname", **job},
    }
    if checks is not None:
        doc["checks"] = checks
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return path


def remote_ls(lab, i: int, pattern: str) -> list[str]:
    """Paths matching a shell glob on lab host i (empty if none)."""
    res = lab.exec(i, ["sh", "-c", f"for f in {pattern}; do [ -e \"$f\" ] && echo \"$f\"; done; true"])
    return res.stdout.split()


def sshd_lines(lab, i: int) -> list[str]:
    try:
        return lab.sshd_log(i).read_text(errors="replace").splitlines()
    except OSError:
        return []


def host_procs(lab, i: int, run_id: str) -> list[str]:
    """Processes of the run on lab host i (its own PID namespace)."""
    res = lab.exec(i, ["sh", "-c", f"grep -lzxF ORCH_RUN_ID={run_id} /proc/[0-9]*/environ 2>/dev/null; true"])
    return res.stdout.split()


def up_then_kill_controller(cwd: Path, *, procs: int, args=(), timeout: float = 60) -> str:
    """`orch up ARGS` in `cwd`, SIGKILLed (laptop closed) once the run has started and at least
    `procs` of its processes run; returns the run id."""
    import signal

    proc = spawn_orch("up", *args, cwd=cwd)
    try:
        assert wait_until(lambda: running(cwd), timeout), "the run did not start"
        run_id = run_record(cwd)["id"]
        assert wait_until(lambda: len(leftovers(run_id)) >= procs, timeout), leftovers(run_id)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    return run_id
