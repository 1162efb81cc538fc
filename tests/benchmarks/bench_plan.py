"""Timing of make_plan and the renderers on big in-memory clusters (not collected by pytest).

    python tests/benchmarks/bench_plan.py

Targets: 1024 x 8 ranks < 1 s, 8192 x 8 ranks < 10 s (plan + every render).
"""

from __future__ import annotations

import ipaddress
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.rankplan import device_ips_for, make_plan
from orchestrator.launchers.mpirun import hostfile, mpirun_argv
from orchestrator.launchers.msrun import msrun_argv
from orchestrator.launchers.ranktable import rank_env, rank_table_legacy, rank_table_v1
from orchestrator.launchers.show import launch_commands, plan_files
from orchestrator.spec import Cluster, Host, Job


def build(n_hosts: int, launcher: str) -> Cluster:
    base = int(ipaddress.ip_address("10.0.0.0"))
    hosts = []
    for i in reversed(range(n_hosts)):  # worst case for the sort: inventory in reverse order
        addr = str(ipaddress.ip_address(base + i + 1))
        ips = {d: f"192.{168 + d % 8}.{i // 256}.{i % 256}" for d in range(8)}
        hosts.append(Host(name=f"node{i:05d}", address=addr, user="train", slots=8, devices=tuple(range(8)),
                          device_ips=ips))
    job = Job(workdir="/data/job", command=("python", "net.py"), launcher=launcher, platform="ascend",
              env={"DATA_PATH": "/data/mnist"})
    return Cluster(name="bench", path=Path("/tmp/bench.yaml"), hosts=tuple(hosts), job=job)


def timed(label: str, fn, results: list):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    results.append((label, dt))
    return out


def bench(n_hosts: int, target: float) -> None:
    results: list[tuple[str, float]] = []
    c = timed("build cluster (not counted)", lambda: build(n_hosts, "ranktable"), [])
    plan = timed("make_plan", lambda: make_plan(c), results)
    ips = timed("device_ips_for", lambda: device_ips_for(plan, {}), results)
    timed("rank_table_v1", lambda: rank_table_v1(plan, ips), results)
    timed("rank_table_legacy", lambda: rank_table_legacy(plan, ips), results)
    timed("rank_env x all ranks", lambda: [rank_env(c, plan, r, "/data/job/rank_table.json") for r in plan.ranks],
          results)
    timed("hostfile", lambda: hostfile(plan), results)
    timed("mpirun_argv", lambda: mpirun_argv(c, plan, hostfile_path="/data/job/hostfile", root=False), results)
    cm = build(n_hosts, "msrun")
    pm = make_plan(cm)
    timed("msrun_argv x all hosts", lambda: [msrun_argv(cm, pm, h.name) for h in pm.hosts], results)
    timed("launch_commands (ranktable)", lambda: launch_commands(c, plan, root=False), results)
    core = sum(dt for _, dt in results)
    timed("plan_files (orch plan --out)", lambda: plan_files(c, plan, device_ips=ips, root=False), results)
    total = sum(dt for _, dt in results)
    print(f"{n_hosts} hosts x 8 = {plan.size} ranks (target {target:g} s)")
    for label, dt in results:
        print(f"  {label:32s} {dt * 1000:9.1f} ms")
    print(f"  {'plan + renders':32s} {core * 1000:9.1f} ms  {'OK' if core < target else 'OVER TARGET'}")
    print(f"  {'total incl. plan_files':32s} {total * 1000:9.1f} ms")


if __name__ == "__main__":
    bench(1024, 1.0)
    bench(8192, 10.0)
