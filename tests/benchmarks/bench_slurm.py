"""Time from `orch up` to the first rank running: through Slurm vs over SSH, same lab hosts.

    python tests/benchmarks/bench_slurm.py [N]     (root: makes its own N-host lab with Slurm; default 4)

One job (ranktable launcher, 2 ranks per host, each printing the time it started), run
alternately from the lab's listed-hosts inventory and from its Slurm inventory; medians of 5
runs each, preflight included (as a user runs it). Also the whole `orch up` of that short job.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.lab import Lab

ORCH = [sys.executable, "-m", "orchestrator.cli"]
STARTED = ["python3", "-c", "import time; print('started', repr(time.time()), flush=True)"]


def one(d: Path, inventory, workdir: str) -> tuple[float, float]:
    doc = {"inventory": inventory, "job": {"launcher": "ranktable", "workdir": workdir, "command": STARTED},
           "checks": {"versions": ["python"]}}
    (d / "cluster.yaml").write_text(yaml.safe_dump(doc))
    t0 = time.time()
    res = subprocess.run([*ORCH, "up", "-q"], cwd=d, capture_output=True, timeout=300)
    total = time.time() - t0
    assert res.returncode == 0, res.stderr.decode()
    logs = subprocess.run([*ORCH, "logs"], cwd=d, capture_output=True, timeout=60).stdout.decode()
    first = min(float(line.rsplit(" ", 1)[1]) for line in logs.splitlines() if "started" in line)
    return first - t0, total


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    lab = Lab(f"bq{os.getpid() % 100000}")
    lab.up(n, slurm=True)
    try:
        listed = yaml.safe_load(lab.inventory_path.read_text())
        slurm_inv = yaml.safe_load(lab.slurm_inventory_path.read_text())
        runs: dict[str, list[tuple[float, float]]] = {"ssh": [], "slurm": []}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(5):
                for kind, inv in (("ssh", listed), ("slurm", slurm_inv)):
                    d = Path(tmp) / f"{kind}{i}"
                    d.mkdir()
                    runs[kind].append(one(d, inv, f"/data/bench-{kind}"))
        print(f"orch up -> first rank running, {n} lab hosts x 2 ranks (ranktable, preflight included), "
              "median of 5 alternating runs:")
        for kind, label in (("ssh", "over SSH (listed hosts)"), ("slurm", "through Slurm (sbatch + srun steps)")):
            first = [r[0] for r in runs[kind]]
            total = [r[1] for r in runs[kind]]
            print(f"  {label:<38} first rank {statistics.median(first):.2f} s   whole orch up "
                  f"{statistics.median(total):.2f} s   runs {[round(x, 2) for x in first]}")
    finally:
        lab.down()


if __name__ == "__main__":
    main()
