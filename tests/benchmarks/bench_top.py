"""What `orch top` costs to lay out (orchestrator/top.py), from a run's document in memory.

    python tests/benchmarks/bench_top.py

1,024 ranks (128 hosts x 8) and 8,192 ranks (1,024 x 8), one rank lagging, one host failed:
prints the milliseconds `top.lines` and `top.as_json` take and how many lines come out. The
round trip to the launch host (as `orch status`) comes on top; not measured here. Then `orch up`'s
live view on a 50 x 160 terminal, as it is redrawn once a second (and on a change of the counts):
the head's document to a RunView (runstate.from_head), the view laid out (top.panel), and the bytes
one redraw writes to the terminal (live.draw).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator import live, runstate, top
from orchestrator.runstate import RunView


def view(hosts: int, per: int) -> RunView:
    ranks = [{"rank": h * per + i, "host": f"node{h + 1:04d}", "state": "failed" if h == 5 else "running"}
             for h in range(hosts) for i in range(per)]
    prog = {str(r["rank"]): {"total": 10 if r["rank"] == 77 else 500, "step": 500, "loss": 0.5, "rate": 2.0,
                             "out": time.time() - 1} for r in ranks}
    load = {f"node{h + 1:04d}": {"cpu": 700.0, "mem_mib": 9000.0, "acc_util": 90.0} for h in range(hosts)}
    return RunView(state="running", attempt=1, ranks=ranks, progress=prog, load=load, run_id="R")


def main() -> None:
    print(f"{'ranks':>6}{'lines ms':>10}{'json ms':>10}{'lines out':>11}")
    for hosts in (128, 1024):
        v = view(hosts, 8)
        t0 = time.perf_counter()
        out = top.lines(v, time.time())
        t1 = time.perf_counter()
        top.as_json(v, time.time())
        t2 = time.perf_counter()
        print(f"{hosts * 8:>6}{1000 * (t1 - t0):>10.1f}{1000 * (t2 - t1):>10.1f}{len(out):>11}")
    print(f"\n`orch up` live view, per redraw\n{'ranks':>6}{'from_head ms':>14}{'panel ms':>10}{'rows':>6}{'bytes':>7}")
    for hosts in (128, 1024):
        v = view(hosts, 8)
        doc = {"run": "R", "state": "running", "attempt": 1, "ranks": v.ranks, "progress": v.progress,
               "load": v.load}
        t0 = time.perf_counter()
        v = runstate.from_head(doc)
        t1 = time.perf_counter()
        rows = top.panel("orch: counts", v, time.time(), 50, 160)
        t2 = time.perf_counter()
        print(f"{hosts * 8:>6}{1000 * (t1 - t0):>14.1f}{1000 * (t2 - t1):>10.1f}{len(rows):>6}"
              f"{len(live.draw(rows).encode()):>7}")


if __name__ == "__main__":
    main()
