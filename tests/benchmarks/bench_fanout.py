"""Fan-out to 256 hosts: how `orch check`'s wall time, CPU and memory grow with the host count.

    python tests/benchmarks/bench_fanout.py [--sizes 64,128,256] [--repeat 2] [--keep]

Two labs of 128 hosts (`pbfa`, `pbfb`: a lab is one /24, 240 hosts at most), in one inline
inventory (each host with its own lab's key and known_hosts). For each size:

- orch:  `orch check FILE --json` with `checks.skip: [mesh]`: connect (64 at a time, ssh.fanout),
         one probe per host, judge; the launch host's ssh test to every other host is left out
         here, as it measures that one host and not the fan-out (it is in bench_check);
- pdsh:  `pdsh -R ssh -f 64` sending the same probe (OpenSSH's default key exchange).

Reported: median wall, controller CPU (total and per host), peak RSS of orch's process (pdsh is
many processes: not shown), SSH connections per host. Everything runs on this machine: the 256
sshds and probes share its 2 cores with the controller, so wall time here is an upper bound of
what a real cluster sees.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    ORCH, SshdCounter, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, pdsh_available,
    pdsh_env, remote_sh, table, write_cluster,
)

LAB_SIZE = 128
END = b"@@orch:end clock1 "


def run_orch(cluster: Path, n: int):
    m = measure(ORCH + ["check", str(cluster), "--json"], env=base_env(), timeout=900)
    try:
        report = json.loads(m.stdout)
        complete = sum(1 for r in report["results"] if r["check"] == "ssh" and r["status"] == "pass") == n
    except ValueError:
        complete = False
    return m, complete


def run_pdsh(hosts, probe: str):
    cmds = []
    for lab in dict.fromkeys(h.lab for h in hosts):  # one pdsh per lab (each has its own key)
        env = pdsh_env(lab)
        mine = [h.address for h in hosts if h.lab is lab]
        cmds.append(f"PDSH_SSH_ARGS_APPEND={shlex.quote(env['PDSH_SSH_ARGS_APPEND'])} pdsh -R ssh "
                    f"-f {max(1, 64 * len(mine) // len(hosts))} -w {','.join(mine)} {shlex.quote(remote_sh(probe))}")
    m = measure(["sh", "-c", " & ".join(cmds) + "; wait"], env=pdsh_env(hosts[0].lab), timeout=900)
    return m, m.stdout.count(END) == len(hosts)


def bench(sizes: list[int], repeat: int, keep: bool):
    need = max(sizes)
    labs = [lab_up(name, LAB_SIZE) for name in ("pbfa", "pbfb")[: (need + LAB_SIZE - 1) // LAB_SIZE]]
    tools = ["orch"] + (["pdsh"] if pdsh_available() else [])
    rows, records = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-fanout-") as tmp:
            work = Path(tmp)
            for n in sizes:
                # spread over both labs as soon as there are two: the controller works both bridges
                per = [h for pair in zip(*(lab_hosts([lab], LAB_SIZE) for lab in labs)) for h in pair] \
                    if len(labs) > 1 else lab_hosts(labs, need)
                hosts = per[:n]
                cluster = write_cluster(work / f"fan{n}.yaml", hosts, checks={"skip": ["mesh"]})
                probe = measure(ORCH + ["check", str(cluster), "--print-probe", hosts[-1].name],
                                env=base_env()).check("--print-probe").stdout.decode()
                samples: dict[str, list] = {t: [] for t in tools}
                for rep in range(repeat):
                    for tool in (tools if rep % 2 == 0 else tools[::-1]):
                        counter = SshdCounter(hosts).start()
                        m, complete = run_orch(cluster, n) if tool == "orch" else run_pdsh(hosts, probe)
                        conns = counter.from_controller()
                        samples[tool].append((m, complete, conns))
                        print(f"  fanout n={n} {tool:5s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:6.2f}s "
                              f"rss {m.maxrss_kb // 1024} MiB conns/host {conn_summary(conns)} complete={complete}",
                              file=sys.stderr, flush=True)
                for tool in tools:
                    s = samples[tool]
                    wall, cpu = median([m.wall for m, _, _ in s]), median([m.cpu for m, _, _ in s])
                    rec = {"bench": "fanout", "hosts": n, "tool": tool, "wall_s": wall, "cpu_s": cpu,
                           "cpu_ms_per_host": 1000 * cpu / n, "maxrss_mib": max(m.maxrss_kb for m, _, _ in s) / 1024,
                           "conns_per_host": conn_summary([c for _, _, cs in s for c in cs]),
                           "complete": all(c for _, c, _ in s)}
                    records.append(rec)
                    rows.append([str(n), tool, fmt(wall, " s"), fmt(cpu, " s"), fmt(rec["cpu_ms_per_host"], " ms", 1),
                                 fmt(rec["maxrss_mib"], " MiB", 0) if tool == "orch" else "-", rec["conns_per_host"],
                                 "yes" if rec["complete"] else "NO"])
    finally:
        if not keep:
            for lab in labs:
                lab.down()
    return table(["hosts", "tool", "wall (median)", "CPU", "CPU/host", "peak RSS", "conns/host", "complete"],
                 rows), records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,128,256")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    text, _ = bench([int(x) for x in a.sizes.split(",")], a.repeat, a.keep)
    print(text)


if __name__ == "__main__":
    main()
