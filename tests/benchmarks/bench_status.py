"""`orch status` of a run that ended: its wall time and the hosts it connects to.

    python tests/benchmarks/bench_status.py [N]      (root: makes its own N-host lab, default 32)
    ORCH_BENCH_BEFORE=DIR python tests/benchmarks/bench_status.py [N]

Runs one short job (one rank per host, ranktable) with this tree, waits until every host's
supervisor has exited (each member's last report tells the head that nothing of the run is left
on its host), then runs plain `orch status` 5 times and prints the median wall and CPU time and the
SSH connections each host accepted from this machine. With ORCH_BENCH_BEFORE (another copy of
the package, e.g. `git archive main orchestrator | tar -x -C DIR`), that copy's `orch status`
is measured against the same run too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ORCH, ROOT, Lab, base_env, SshdCounter, lab_hosts, measure, median, write_cluster
from tests.support import leftovers, wait_until

REPEAT = 5


def statuses(d: Path, hosts, src: str) -> tuple[float, float, str]:
    """Median wall and CPU seconds of `orch status` (PYTHONPATH=src), and the connections it made."""
    env = base_env(src)
    walls, cpus, conns = [], [], []
    for _ in range(REPEAT):
        counter = SshdCounter(hosts).start()
        m = measure([*ORCH, "status"], env=env, cwd=d).check("orch status")
        walls.append(m.wall)
        cpus.append(m.cpu)
        per_host = counter.from_controller()
        conns.append(f"{sum(per_host)} connection(s) on {sum(1 for c in per_host if c)} host(s)")
    return median(walls), median(cpus), conns[-1]


def main(n: int) -> None:
    lab = Lab(f"bst{os.getpid() % 10000}")
    lab.up(n)
    try:
        hosts = lab_hosts([lab], n)
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            write_cluster(d / "cluster.yaml", hosts, slots=1,
                          job={"launcher": "ranktable", "command": "true", "workdir": "/data/bench-status"})
            measure([*ORCH, "up", "-q", "--skip-checks"], env=base_env(),
                    cwd=d).check("orch up")
            run_id = sorted(p.name for p in (d / ".orch" / "runs").iterdir())[-1]
            assert wait_until(lambda: leftovers(run_id) == [], 60)
            rows = [("this tree", *statuses(d, hosts, str(ROOT)))]
            before = os.environ.get("ORCH_BENCH_BEFORE")
            if before:
                rows.append((f"ORCH_BENCH_BEFORE ({before})", *statuses(d, hosts, before)))
    finally:
        lab.down()
    print(f"plain `orch status` of an ended run on {n} lab hosts (1 rank each), median of {REPEAT}:")
    for what, wall, cpu, conns in rows:
        print(f"  {what:45} wall {wall:5.2f} s  controller CPU {cpu:5.2f} s  {conns}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
