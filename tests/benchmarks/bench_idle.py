"""What a live run's supervisors cost while its ranks run and say nothing.

    python tests/benchmarks/bench_idle.py [N] [--seconds 20] [--lab NAME] [--keep] [--before SRC]

Starts `orch up --detach` of N lab hosts (default 32) x 8 ranks (ranktable), each rank
`sleep`ing, waits until every supervisor has run a few seconds, then reads the CPU time (user +
system, /proc/PID/stat) of the run's supervisors twice, `--seconds` apart: the head's, and each
member's (a supervisor is a process whose environment has ORCH_AGENT=1 and the run's id; its
host is its network namespace). Prints milliseconds of CPU a second: the head, a member (median),
all members together; with --before, the same from another copy of the package, side by side.
The run is stopped (`orch down`) after each measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ORCH, ROOT, base_env, lab_hosts, lab_up, table, write_cluster

SLOTS = 8
WORKDIR = "/data/bench-idle"
SETTLE = 8.0   # seconds after the start before the first reading: joins, spawns and first load samples done


def supervisors(run_id: str) -> list[int]:
    """Pids of the run's supervisors on this machine (every lab host's process is visible here)."""
    run, agent = f"ORCH_RUN_ID={run_id}".encode(), b"ORCH_AGENT=1"
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if run in env and agent in env:
            out.append(int(p))
    return out


def cpu_ms(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def measure(cluster: Path, src: str, lab, seconds: float) -> dict:
    env = base_env(src)
    up = subprocess.run(ORCH + ["up", "--detach", "--force", str(cluster)], env=env, capture_output=True,
                        text=True, timeout=600, cwd=cluster.parent)
    run_id = up.stdout.strip().splitlines()[-1] if up.returncode == 0 and up.stdout.strip() else None
    if run_id is None:
        raise SystemExit(f"orch up failed ({up.returncode}): {up.stderr[-2000:]}")
    try:
        time.sleep(SETTLE)
        head_ns = os.stat(f"/run/netns/{lab.netns_name(1)}").st_ino
        pids = supervisors(run_id)
        first = {p: cpu_ms(p) for p in pids}
        time.sleep(seconds)
        last = {p: cpu_ms(p) for p in pids}
        used = {p: (last[p] - first[p]) / seconds for p in pids
                if first[p] is not None and last[p] is not None}
        head = [v for p, v in used.items() if netns_inode(p) == head_ns]
        members = [v for p, v in used.items() if netns_inode(p) != head_ns]
        return {"run": run_id, "supervisors": len(used), "head": head[0] if len(head) == 1 else None,
                "member": statistics.median(members) if members else None, "members": sum(members)}
    finally:
        subprocess.run(ORCH + ["down", "--run", run_id], env=env, capture_output=True,
                       timeout=600, cwd=cluster.parent)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hosts", nargs="?", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    ap.add_argument("--lab", default=None, help="the lab's name (default pbid<N>); an existing one is reused")
    ap.add_argument("--before", default=None, metavar="SRC", help="also measure this copy of the package")
    a = ap.parse_args(argv)
    lab = lab_up(a.lab or f"pbid{a.hosts}", a.hosts)
    hosts = lab_hosts([lab], a.hosts)
    trees = [("orch", str(ROOT))] + ([("before", a.before)] if a.before else [])
    got = {}
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-idle-") as tmp:
            for tree, src in trees:
                d = Path(tmp) / tree
                d.mkdir()
                cluster = write_cluster(d / "cluster.yaml", hosts, slots=SLOTS, ssh={"fanout": 128},
                                        job={"launcher": "ranktable", "platform": "ascend",
                                             "command": ["sleep", str(int(SETTLE + a.seconds + 60))],
                                             "workdir": WORKDIR + ("-before" if tree == "before" else ""),
                                             "timeout": 600},
                                        checks={"versions": ["python"]})   # no MindSpore, no CANN on a lab
                got[tree] = measure(cluster, src, lab, a.seconds)
                print(f"  {tree}: {got[tree]}", file=sys.stderr, flush=True)
    finally:
        if not a.keep:
            lab.down()

    def ms(v):
        return "-" if v is None else f"{v:.2f} ms/s"

    print(f"a run's supervisors while its {a.hosts} x {SLOTS} ranks sleep ({a.seconds:g} s read, "
          f"{SETTLE:g} s after the start; CPU time, user + system):")
    rows = [["the head"] + [ms(got[t]["head"]) for t, _ in trees],
            ["a member (median)"] + [ms(got[t]["member"]) for t, _ in trees],
            [f"all {a.hosts - 1} members"] + [ms(got[t]["members"]) for t, _ in trees],
            ["supervisors found"] + [str(got[t]["supervisors"]) for t, _ in trees]]
    print(table(["", *[t for t, _ in trees]], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
