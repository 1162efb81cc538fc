"""Launch overhead: `orch up` of a hello-world mpirun job against doing it by hand.

    python tests/benchmarks/bench_up.py [--repeat 3] [--keep]

4 lab hosts x 2 ranks (lab `pbup`), job `echo hello` under mpirun.

- orch:   `orch up FILE -q`: checks, render + distribute (hostfile), launch, follow, gather
          every rank's log into .orch/runs/<id>/logs;
- manual: what one types without orch: `ssh head mpirun --allow-run-as-root -H a:2,b:2,c:2,d:2
          -np 8 --output-filename DIR/log_output echo hello`, then `ssh host tar c log_output |
          tar x` from the 4 hosts at once.

Reported: median wall time, controller CPU, SSH connections each host accepted from the
controller, and every rank's log was gathered. Targets: orch / manual <= 1.5; 1 connection
per host.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (  # noqa: E402
    ORCH, SshdCounter, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, ssh_base, table,
    write_cluster,
)

N_HOSTS, SLOTS = 4, 2
WORKDIR = "/data/benchup"


def run_orch(cluster: Path, cwd: Path):
    m = measure(ORCH + ["up", str(cluster), "-q"], env=base_env(), cwd=cwd, timeout=300)
    runs = sorted((cwd / ".orch" / "runs").glob("*/logs"), key=lambda p: p.stat().st_mtime)
    logs = runs[-1] if runs else None
    complete = logs is not None and all(
        (logs / f"rank.{r}" / "stdout").read_bytes() == b"hello\n" for r in range(N_HOSTS * SLOTS))
    return m, complete


def run_manual(hosts, dest: Path):
    head = hosts[0]
    spec = ",".join(f"{h.address}:{SLOTS}" for h in hosts)
    mpirun = (f"rm -rf {WORKDIR}/log_output && mkdir -p {WORKDIR} && cd {WORKDIR} && "
              f"mpirun --allow-run-as-root -H {spec} -np {N_HOSTS * SLOTS} --output-filename "
              f"{WORKDIR}/log_output echo hello")
    fetch = []
    for h in hosts:
        d = dest / h.name
        d.mkdir(parents=True, exist_ok=True)
        fetch.append(f"{shlex.join(ssh_base(h))} {h.address} {shlex.quote(f'cd {WORKDIR} && tar c log_output')} "
                     f"| tar x -C {shlex.quote(str(d))} &")
    script = (f"{shlex.join(ssh_base(head))} {head.address} {shlex.quote(mpirun)} >/dev/null || exit 1\n"
              + "\n".join(fetch) + "\nwait")
    m = measure(["sh", "-c", script], env=base_env(), timeout=300)
    got = 0
    for h in hosts:
        got += sum(1 for p in (dest / h.name / "log_output" / "1").glob("rank.*/stdout")
                   if p.read_bytes() == b"hello\n")
    return m, got == N_HOSTS * SLOTS


def bench(repeat: int, keep: bool, lab_name: str = "pbup"):
    lab = lab_up(lab_name, N_HOSTS)
    hosts = lab_hosts([lab], N_HOSTS)
    samples: dict[str, list] = {"orch": [], "manual": []}
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-up-") as tmp:
            work = Path(tmp)
            cluster = write_cluster(work / "up.yaml", hosts, slots=SLOTS,
                                    job={"workdir": WORKDIR, "command": ["echo", "hello"], "launcher": "mpirun",
                                         "platform": "cpu", "log_dir": "log_output"})
            for rep in range(repeat):
                for tool in (["orch", "manual"] if rep % 2 == 0 else ["manual", "orch"]):
                    counter = SshdCounter(hosts).start()
                    if tool == "orch":
                        m, complete = run_orch(cluster, work)
                    else:
                        m, complete = run_manual(hosts, work / f"manual{rep}")
                    conns = counter.from_controller()
                    samples[tool].append((m, complete, conns))
                    print(f"  up {tool:6s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:5.2f}s rc {m.rc} "
                          f"conns/host {conn_summary(conns)} complete={complete}", file=sys.stderr, flush=True)
    finally:
        if not keep:
            lab.down()
    rows, records = [], []
    for tool, s in samples.items():
        rec = {"bench": "up", "tool": tool, "wall_s": median([m.wall for m, _, _ in s]),
               "cpu_s": median([m.cpu for m, _, _ in s]),
               "conns_per_host": conn_summary([c for _, _, cs in s for c in cs]),
               "complete": all(c and m.rc == 0 for m, c, _ in s), "walls": [round(m.wall, 2) for m, _, _ in s]}
        records.append(rec)
    ratio = records[0]["wall_s"] / records[1]["wall_s"]
    for r in records:
        rows.append([f"{N_HOSTS}x{SLOTS}", r["tool"], fmt(r["wall_s"], " s"), fmt(r["cpu_s"], " s"),
                     r["conns_per_host"], "yes" if r["complete"] else "NO", " ".join(f"{w:.2f}" for w in r["walls"])])
    text = table(["hosts x ranks", "how", "wall (median)", "CPU", "conns/host", "all logs back", "walls"], rows)
    text += f"\norch / manual = {ratio:.2f} (target <= 1.5)"
    records.append({"bench": "up", "ratio": ratio})
    return text, records


def verdicts(records) -> list[str]:
    ratio = next(r["ratio"] for r in records if "ratio" in r)
    o = next(r for r in records if r.get("tool") == "orch")
    return [f"{'MET ' if ratio <= 1.5 else 'MISS'} orch up / manual <= 1.5: {ratio:.2f}",
            f"{'MET ' if o['conns_per_host'] == '1' else 'MISS'} orch up: 1 connection per host: {o['conns_per_host']}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    text, records = bench(a.repeat, a.keep)
    print(text)
    print("\n".join(verdicts(records)))


if __name__ == "__main__":
    main()
