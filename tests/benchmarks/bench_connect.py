"""SSH connection setup cost per host: wall time and controller CPU.

    python tests/benchmarks/bench_connect.py [N]      (root, Linux: makes lab 'bcon' with N hosts)

Connects to every host once (sequentially, then again fanned out) with orch's
SshTransport and prints wall and CPU per connection, then one round trip on an
open connection for comparison.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

from orchestrator.fanout import fan_out
from orchestrator.lab import Lab
from orchestrator.spec import load_cluster
from orchestrator.transport import Pool


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(n: int) -> None:
    lab = Lab("bcon").up(n)
    try:
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "c.yaml"
            f.write_text(yaml.safe_dump({"inventory": str(lab.inventory_path),
                                         "job": {"workdir": "/data/b", "command": "true"}}))
            c = load_cluster(f)
            rows = []
            with Pool(c) as pool:
                w0, c0 = time.perf_counter(), cpu()
                for h in c.hosts:
                    pool[h].connect()
                rows.append(("connect, one host after another", time.perf_counter() - w0, cpu() - c0))
                w0, c0 = time.perf_counter(), cpu()
                for h in c.hosts:
                    pool[h].run(["true"])
                rows.append(("one command on an open connection", time.perf_counter() - w0, cpu() - c0))
            with Pool(c) as pool:
                w0, c0 = time.perf_counter(), cpu()
                fan_out(c.hosts, lambda h: pool[h].connect(), limit=64)
                rows.append(("connect, fanned out (fanout 64)", time.perf_counter() - w0, cpu() - c0))
    finally:
        lab.down()
    print(f"{n} lab hosts, paramiko {__import__('paramiko').__version__}, ed25519 keys")
    print(f"{'what':40} {'wall/host ms':>13} {'cpu/host ms':>12} {'total wall s':>13}")
    for what, wall, c in rows:
        print(f"{what:40} {wall / n * 1000:13.1f} {c / n * 1000:12.1f} {wall:13.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
