"""What the head pushes to a watcher each second (agent/delta.py), at 8,192 ranks.

    python tests/benchmarks/bench_watch.py [--ranks 8192] [--seconds 60]

The head's publish, in process (no network): 1,024 hosts x 8 ranks of a training run, each rank's
progress moving every second, each host's load every 5 s, one rank ending every 10 s. Prints
the bytes a watcher receives per second (the frames' JSON) as it was before (the whole document
on every publish), with deltas, and with deltas whose figures go out every 5 s (what the head
does), and the head's CPU per publish for each.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.agent import delta, protocol


def doc_of(n: int) -> dict:
    return {"v": 1, "run": "R", "state": "running", "attempt": 1, "attempts": [{"attempt": 1, "state": "running"}],
            "ranks": [{"rank": r, "host": f"node{r // 8:04d}", "device": r % 8, "pid": 10000 + r, "state": "running",
                       "exit_code": None, "signal": None, "start": 1.0, "end": None, "attempt": 1} for r in range(n)],
            "progress": {}, "load": {}, "lost": [], "message": "", "reached": {}}


def tick(doc: dict, t: int) -> None:
    for r in doc["ranks"]:
        k = str(r["rank"])
        doc["progress"][k] = {"rank": r["rank"], "step": t, "epoch": 1, "loss": round(2.0 / (t + 1), 6),
                              "total": t, "records": t, "rate": 1.0, "out": 1000.0 + t, "t_step": 1000.0 + t}
    if t % 5 == 0:
        for h in range(len(doc["ranks"]) // 8):
            doc["load"][f"node{h:04d}"] = {"t": 1000.0 + t, "procs": 9, "cpu": 700.0 + t % 7, "mem_mib": 9000.0,
                                           "host_mem_pct": 40.0, "host_mem_mib": 500000, "loadavg": 8.0}
    if t % 10 == 0:
        r = doc["ranks"][t // 10]
        r.update(state="exited", exit_code=0, end=1000.0 + t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8192)
    ap.add_argument("--seconds", type=int, default=60)
    a = ap.parse_args()
    print(f"{a.ranks} ranks, {a.seconds} s of a training run, one publish a second")
    print(f"{'what the watcher gets':<36}{'bytes/s':>14}{'head CPU ms/publish':>22}")
    for label, mode in (("whole document (before)", "full"), ("deltas", "delta"),
                        (f"deltas, figures every {delta.figures_every(a.ranks):g} s (now)", "throttled")):
        doc = doc_of(a.ranks)
        pub = delta.Publisher(doc)
        sent = 0
        cpu = 0.0
        for t in range(1, a.seconds + 1):
            tick(doc, t)
            c0 = time.process_time()
            if mode == "full":
                sent += len(protocol.encode(protocol.state(doc)))
            else:
                change = pub.next(doc, float(t) if mode == "throttled" else None)
                if change:
                    sent += len(protocol.encode(protocol.delta(*change)))
            cpu += time.process_time() - c0
        print(f"{label:<36}{sent / a.seconds:>14,.0f}{1000 * cpu / a.seconds:>22.1f}", flush=True)


if __name__ == "__main__":
    main()
