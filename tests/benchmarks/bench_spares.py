"""What spare hosts cost the controller and the wire, before anything goes wrong, and what the
head's decision costs when a host is lost (orchestrator/launchers.spare_launch, agent/head.py).

    python tests/benchmarks/bench_spares.py

For a ranktable (Ascend, rank table 1.0) job of H hosts x 8 devices with S spares: the seconds
`launchers.build` takes with and without the spares (each spare's processes rendered for every
host it may replace), the bytes of the configurations the supervisors are given (a spare's and
the head's), and, once a host is lost, the milliseconds the head's `decide` takes to choose the
spare and render the rank table for the new host set, and the start message's packed files.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator import launchers, supervisor
from orchestrator.agent import head as H
from orchestrator.model import Cluster, Host, Job
from orchestrator.rankplan import make_plan


def cluster(hosts: int, spares: int) -> Cluster:
    hs = [Host(name=f"n{i:04d}", address=f"10.{i // 250}.{i % 250}.1", user="u", slots=8, devices=tuple(range(8)),
               device_ips={d: f"10.{100 + i // 250}.{i % 250}.{d + 1}" for d in range(8)}, spare=i >= hosts)
          for i in range(hosts + spares)]
    return Cluster(name="b", path=Path("/tmp/c.yaml"), hosts=tuple(hs),
                   job=Job(workdir="/data/w", command=("python", "train.py"), launcher="ranktable", platform="ascend"))


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def main() -> None:
    print(f"{'hosts':>6}{'spares':>7}{'build s':>9}{'no-spare s':>11}{'spare cfg KiB':>14}{'head cfg KiB':>13}"
          f"{'decide ms':>10}{'files KiB':>10}")
    for hosts, spares in ((16, 1), (128, 1), (128, 4), (512, 2)):
        c = cluster(hosts, spares)
        p = make_plan(c)
        ips = {h.name: dict(h.device_ips) for h in c.hosts}
        launch, took = timed(launchers.build, c, p, "R", root={}, device_ips=ips)
        _, base = timed(launchers.build, c, make_plan(cluster(hosts, 0)), "R", root={}, device_ips=ips)
        cfgs = supervisor.configs(c, p, "R", launch)
        spare_cfg = cfgs[p.spares[0].name]
        head_cfg = cfgs[p.launch_host.name]
        head = H.Head(dict(json.loads(json.dumps(head_cfg)), lost_after=1e9), 0.0)   # nobody silent here
        names = [h.name for h in p.all_hosts[1:]]
        H.decide(head, [H.joined(n, "10.0.0.1") for n in names], 1.0)
        H.decide(head, [H.gone(p.hosts[1].name)], 2.0)
        H.decide(head, [], 2.1)
        H.decide(head, [], 100.0)                 # the stop's wait is over: the spare is chosen
        t0 = time.perf_counter()
        _, actions = H.decide(head, [], 100.1)    # the delay is over: replace, render, start
        t1 = time.perf_counter()
        files = next((a[3]["files"] for a in actions if a[0] == "start"), "")
        print(f"{hosts:>6}{spares:>7}{took:>9.2f}{base:>11.2f}{len(json.dumps(spare_cfg)) / 1024:>14.0f}"
              f"{len(json.dumps(head_cfg)) / 1024:>13.0f}{1000 * (t1 - t0):>10.1f}{len(files) / 1024:>10.1f}")


if __name__ == "__main__":
    main()
