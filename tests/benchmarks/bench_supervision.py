"""How fast a run's supervision acts, and what following a run costs the controller.

    python tests/benchmarks/bench_supervision.py      (root: makes its own 4-host lab)

Prints, as medians of 3 runs on 4 lab hosts x 1 rank (ranktable launcher; rank 2 fails after 2 s,
the others sleep):
- fail-fast: from the failing rank's exit to the last process of the run gone, attached
  (`orch up`) and detached (`orch up --detach`, no controller);
- following: the remote commands the controller ran while following a 10 s job (one
  long-lived stream; round trips per second per host).
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
from tests.support import leftovers, wait_until

ORCH = [sys.executable, "-m", "orchestrator.cli"]
FAILER = ["sh", "-c", 'echo up $RANK_ID; if [ "$RANK_ID" = 2 ]; then sleep 2; date +%s.%N > failed_at; exit 3; fi; '
                      "exec sleep 120"]
# counts every remote command the controller runs (one per transport call)
COUNTING = ("import sys, orchestrator.transport.base as b\n"
            "n = [0]\norig = b.Transport.run\n"
            "def run(self, *a, **k):\n    n[0] += 1\n    return orig(self, *a, **k)\n"
            "b.Transport.run = run\n"
            "import atexit; atexit.register(lambda: sys.stderr.write(f'REMOTE_COMMANDS {n[0]}\\n'))\n"
            "from orchestrator.cli import main; sys.argv = ['orch'] + sys.argv[1:]; main()\n")


def cluster(lab: Lab, d: Path, workdir: str, command) -> None:
    inv = yaml.safe_load(Path(lab.inventory_path).read_text())
    inv["defaults"]["slots"] = 1
    doc = {"inventory": inv, "ssh": {"connect_timeout": 5, "retries": 2},
           "job": {"launcher": "ranktable", "workdir": workdir, "command": command}}
    (d / "cluster.yaml").write_text(yaml.safe_dump(doc))


def failed_at(lab: Lab, workdir: str) -> float:
    return float(lab.exec(3, ["cat", f"{workdir}/failed_at"]).stdout)


def fail_fast(lab: Lab, detach: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        wd = f"/data/bench-ff-{int(detach)}"
        lab.exec(3, ["rm", "-f", f"{wd}/failed_at"])
        cluster(lab, d, wd, FAILER)
        res = subprocess.run([*ORCH, "up", "-q", "--skip-checks", *(["--detach"] if detach else [])], cwd=d,
                             capture_output=True, timeout=120)
        run_id = sorted(p.name for p in (d / ".orch" / "runs").iterdir())[-1]
        assert wait_until(lambda: lab.exec(3, ["cat", f"{wd}/failed_at"]).stdout.strip() != "", 30)
        assert wait_until(lambda: leftovers(run_id) == [], 30, interval=0.02), res.stderr.decode()
        return time.time() - failed_at(lab, wd)


def following(lab: Lab, seconds: int = 10) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cluster(lab, d, "/data/bench-follow", ["sh", "-c", f"for i in $(seq {seconds}); do echo $i; sleep 1; done"])
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-c", COUNTING, "up", "--skip-checks"], cwd=d, capture_output=True,
                             timeout=120)
        took = time.monotonic() - t0
        n = int(res.stderr.decode().rsplit("REMOTE_COMMANDS ", 1)[1].split()[0])
        return n, took


def main() -> None:
    lab = Lab(f"bs{os.getpid() % 100000}")
    lab.up(4)
    try:
        att = [fail_fast(lab, False) for _ in range(3)]
        det = [fail_fast(lab, True) for _ in range(3)]
        print("fail-fast, 4 hosts x 1 rank: failing rank's exit -> last process of the run gone")
        print(f"  attached (orch up)         median {statistics.median(att):.2f} s  runs {[round(x, 2) for x in att]}")
        print(f"  detached (no controller)   median {statistics.median(det):.2f} s  runs {[round(x, 2) for x in det]}")
        n, took = following(lab)
        hosts = 4
        print(f"following a 10 s job on {hosts} hosts (orch up, check skipped): {n} remote commands in {took:.1f} s "
              f"(prepare, sync, start, one stream, gather); "
              f"{n / took / hosts:.2f} per second per host, of which while following: 1 stream in all")
    finally:
        lab.down()


if __name__ == "__main__":
    main()
