"""What reading progress from rank output costs (orchestrator/agent/metrics.py).

    python tests/benchmarks/bench_progress.py [--seconds 5] [--repeat 3]   (no lab, no root)

A supervisor (agent.py, this machine's python3, as the hosts run it) runs one rank that prints
MindSpore-style progress lines, paced at 10,000 lines/s, then as fast as it can, each with
progress parsing on and off. Prints, as medians: the lines per second the rank achieved, the
rank's own CPU, the supervisor's CPU (its rusage minus the rank's), and whether the head's
document ended with the rank's last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.integration.test_agent_local import PY, config, rank_proc, start, state

RANK = r"""
import os, sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
i = 0
w = sys.stdout.write
while True:
    now = time.monotonic() - t0
    if now >= seconds:
        break
    if rate:
        due = int(now * rate) + 100
        while i < due:
            i += 1
            w("epoch: 1, step: %d, loss is %.6f lr=0.001 some more text as real logs have\n" % (i, 1.0 / i))
        sys.stdout.flush()
        time.sleep(0.01)
    else:
        for _ in range(1000):
            i += 1
            w("epoch: 1, step: %d, loss is %.6f lr=0.001 some more text as real logs have\n" % (i, 1.0 / i))
el = time.monotonic() - t0
t = os.times()
sys.stdout.write("BENCH %d %.3f %.3f\n" % (i, el, t.user + t.system))
sys.stdout.flush()
time.sleep(1.5)
"""


def once(rate: float, seconds: float, parse: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="orch-bench-progress-") as d:
        tmp = Path(d)
        script = tmp / "rank.py"
        script.write_text(RANK)
        cfg = config(tmp, [rank_proc(0, [PY, str(script), str(rate), str(seconds)])], [0])
        cfg["parse_output"] = parse
        p = start(tmp, cfg)
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = status
        log = (Path(cfg["rundir"]) / "a1" / "1" / "rank.0" / "stdout").read_text()
        last = [ln for ln in log.splitlines() if ln.startswith("BENCH ")][-1].split()
        lines, elapsed, rank_cpu = int(last[1]), float(last[2]), float(last[3])
        prog = (state(cfg).get("progress") or {}).get("0", {})
        return {"lines_per_s": lines / elapsed, "rank_cpu": rank_cpu,
                "agent_cpu": ru.ru_utime + ru.ru_stime - rank_cpu, "last_step_seen": prog.get("step") == lines,
                "skipped": prog.get("skipped", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    print(f"one rank, {a.seconds:g} s, medians of {a.repeat}; supervisor CPU includes its start and end")
    print(f"{'rank prints':<22}{'parsing':<9}{'lines/s':>10}{'rank CPU s':>12}{'supervisor CPU s':>18}"
          f"{'last step in doc':>18}")
    for rate in (10000.0, 0.0):
        for parse in (False, True):
            runs = [once(rate, a.seconds, parse) for _ in range(a.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("lines_per_s", "rank_cpu", "agent_cpu")}
            seen = all(r["last_step_seen"] for r in runs) if parse else "-"
            label = "10,000 lines/s" if rate else "as fast as it can"
            print(f"{label:<22}{'on' if parse else 'off':<9}{med['lines_per_s']:>10,.0f}{med['rank_cpu']:>12.2f}"
                  f"{med['agent_cpu']:>18.2f}{str(seen):>18}", flush=True)
    print(json.dumps({"note": "supervisor CPU = its rusage (rank included) minus the rank's own os.times()"}))


if __name__ == "__main__":
    main()
