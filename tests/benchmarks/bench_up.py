"""Launch overhead: `orch up` of a hello-world mpirun job against doing it by hand.

    python tests/benchmarks/bench_up.py [--repeat 3] [--keep] [--hosts 4 --slots 2]
        [--tree-spawn default|off|both] [--follow] [--before SRC]

N lab hosts x S ranks (default 4 x 2, lab `pbup`; other sizes lab `pbupN`), job `echo hello`
under mpirun.

- orch:   `orch up FILE -q` (--follow: without -q, rank 0's output followed): checks, render +
          distribute (hostfile), launch, follow, gather every rank's log into .orch/runs/<id>/logs;
- manual: what one types without orch: `ssh head mpirun --allow-run-as-root -H a:2,b:2,c:2,d:2
          -np 8 --output-filename DIR/log_output echo hello`, then `ssh host tar c log_output |
          tar x` from every host at once. Its own workdir (orch's makes log_output a link to
          its latest run) and a new output directory each time (no earlier run's file counts).

--tree-spawn off: both pass `-mca plm_rsh_no_tree_spawn 1` (every ssh from the launch host,
as orch's render does above 64 hosts); `both` measures with and without it, alternating.

Reported: median wall time, controller CPU, SSH connections each host accepted from the
controller, commands (round trips) each host ran for it, and every rank's log was gathered.
Targets: orch / manual <= 1.1 (4 x 2), <= 1.3 at 32 and 64 hosts x 1; 1 connection per host.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    ORCH, SshdCounter, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, ssh_base, table,
    write_cluster,
)

N_HOSTS, SLOTS = 4, 2
WORKDIR = "/data/benchup"
MANUAL_WORKDIR = "/data/benchup-manual"
NO_TREE_SPAWN = ["-mca", "plm_rsh_no_tree_spawn", "1"]


def run_orch(cluster: Path, cwd: Path, n_ranks: int, src: str | None = None, follow: bool = False):
    env = base_env()
    if src:  # another copy of the package (--before) in place of this tree's
        env["PYTHONPATH"] = ":".join([src] + env["PYTHONPATH"].split(":")[1:])
    m = measure(ORCH + ["up", str(cluster)] + ([] if follow else ["-q"]), env=env, cwd=cwd, timeout=600)
    runs = sorted((cwd / ".orch" / "runs").glob("*/logs"), key=lambda p: p.stat().st_mtime)
    logs = runs[-1] if runs else None
    complete = logs is not None and all(
        (logs / f"rank.{r}" / "stdout").read_bytes() == b"hello\n" for r in range(n_ranks))
    return m, complete


def run_manual(hosts, slots: int, dest: Path, out_name: str = "log_output", mca: list[str] = ()):
    head = hosts[0]
    spec = ",".join(f"{h.address}:{slots}" for h in hosts)
    out = f"{MANUAL_WORKDIR}/{out_name}"
    mpirun = (f"rm -rf {out} && mkdir -p {MANUAL_WORKDIR} && cd {MANUAL_WORKDIR} && "
              f"mpirun --allow-run-as-root {shlex.join(mca)} -H {spec} -np {len(hosts) * slots} --output-filename "
              f"{out} echo hello")
    fetch = []
    for h in hosts:
        d = dest / h.name
        d.mkdir(parents=True, exist_ok=True)
        fetch.append(f"{shlex.join(ssh_base(h))} {h.address} {shlex.quote(f'cd {MANUAL_WORKDIR} && tar c {out_name}')} "
                     f"| tar x -C {shlex.quote(str(d))} &")
    script = (f"{shlex.join(ssh_base(head))} {head.address} {shlex.quote(mpirun)} >/dev/null || exit 1\n"
              + "\n".join(fetch) + "\nwait")
    m = measure(["sh", "-c", script], env=base_env(), timeout=600)
    got = 0
    for h in hosts:
        got += sum(1 for p in (dest / h.name / out_name / "1").glob("rank.*/stdout")
                   if p.read_bytes() == b"hello\n")
    return m, got == len(hosts) * slots


def bench(repeat: int, keep: bool, lab_name: str = "pbup", n_hosts: int = N_HOSTS, slots: int = SLOTS,
          tree_spawn: str = "default", before: str | None = None, follow: bool = False):
    lab = lab_up(lab_name, n_hosts)
    hosts = lab_hosts([lab], n_hosts)
    variants = {"default": [""], "off": ["no-tree"], "both": ["", "no-tree"]}[tree_spawn]
    kinds = ("orch", "manual") + (("before",) if before else ())
    tools = [f"{t}{'+' + v if v else ''}" for v in variants for t in kinds]
    samples: dict[str, list] = {t: [] for t in tools}
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-up-") as tmp:
            work = Path(tmp)
            clusters = {v: write_cluster(work / f"up{v}.yaml", hosts, slots=slots, job={
                "workdir": WORKDIR, "command": ["echo", "hello"], "launcher": "mpirun", "platform": "cpu",
                "log_dir": "log_output", **({"mpirun_args": NO_TREE_SPAWN} if v else {})}) for v in variants}
            n = 0
            for rep in range(repeat):
                order = tools if rep % 2 == 0 else tools[::-1]
                for tool in order:
                    v = tool.partition("+")[2]
                    counter = SshdCounter(hosts).start()
                    if tool.startswith(("orch", "before")):
                        m, complete = run_orch(clusters[v], work, n_hosts * slots,
                                               before if tool.startswith("before") else None, follow)
                    else:
                        n += 1
                        m, complete = run_manual(hosts, slots, work / f"manual{n}", f"log_output{n}",
                                                 NO_TREE_SPAWN if v else [])
                    conns = counter.from_controller()
                    trips = counter.sessions_from_controller()
                    samples[tool].append((m, complete, conns, trips))
                    print(f"  up {tool:14s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:5.2f}s rc {m.rc} "
                          f"conns/host {conn_summary(conns)} round trips/host {conn_summary(trips)} "
                          f"complete={complete} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    finally:
        if not keep:
            lab.down()
    rows, records = [], []
    for tool, s in samples.items():
        rec = {"bench": "up", "tool": tool, "hosts": n_hosts, "slots": slots,
               "wall_s": median([m.wall for m, *_ in s]), "cpu_s": median([m.cpu for m, *_ in s]),
               "conns_per_host": conn_summary([c for _, _, cs, _ in s for c in cs]),
               "trips_per_host": conn_summary([c for *_, ts in s for c in ts]),
               "complete": all(c and m.rc == 0 for m, c, *_ in s), "walls": [round(m.wall, 2) for m, *_ in s]}
        records.append(rec)
    by_tool = {r["tool"]: r for r in records}
    for r in records:
        rows.append([f"{n_hosts}x{slots}", r["tool"], fmt(r["wall_s"], " s"), fmt(r["cpu_s"], " s"),
                     r["conns_per_host"], r["trips_per_host"], "yes" if r["complete"] else "NO",
                     " ".join(f"{w:.2f}" for w in r["walls"])])
    text = table(["hosts x ranks", "how", "wall (median)", "CPU", "conns/host", "round trips/host", "all logs back",
                  "walls"], rows)
    ratios = []
    for v in variants:
        ratio = by_tool[f"orch{'+' + v if v else ''}"]["wall_s"] / by_tool[f"manual{'+' + v if v else ''}"]["wall_s"]
        ratios.append(ratio)
        text += f"\norch / manual{' (' + v + ')' if v else ''} = {ratio:.2f} (target <= {target(n_hosts):g})"
        records.append({"bench": "up", "ratio": ratio, "variant": v or "default"})
        if before:
            b = by_tool[f"before{'+' + v if v else ''}"]["wall_s"] / by_tool[f"manual{'+' + v if v else ''}"]["wall_s"]
            text += f"\nbefore ({before}) / manual{' (' + v + ')' if v else ''} = {b:.2f}"
    text += f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    return text, records


def target(n_hosts: int) -> float:
    """orch up / the hand-run: 1.1 for the 4 x 2 launch, 1.3 at scale (32, 64 hosts)."""
    return 1.1 if n_hosts <= N_HOSTS else 1.3


def verdicts(records) -> list[str]:
    runs = [r for r in records if "tool" in r]
    goal = target(runs[0]["hosts"])
    out = []
    for r in records:
        if "ratio" in r:
            what = "" if r["variant"] == "default" else f" ({r['variant']})"
            out.append(f"{'MET ' if r['ratio'] <= goal else 'MISS'} orch up / manual{what} <= {goal:g} "
                       f"({runs[0]['hosts']}x{runs[0]['slots']}): {r['ratio']:.2f}")
    for o in (r for r in runs if r["tool"].startswith("orch")):
        out.append(f"{'MET ' if o['conns_per_host'] == '1' else 'MISS'} {o['tool']}: 1 connection per host: "
                   f"{o['conns_per_host']}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--hosts", type=int, default=N_HOSTS)
    ap.add_argument("--slots", type=int, default=SLOTS)
    ap.add_argument("--tree-spawn", choices=("default", "off", "both"), default="default")
    ap.add_argument("--follow", action="store_true", help="`orch up` as typed: rank 0's output followed (no -q)")
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also run `orch up` from this copy of the package (a before/after comparison)")
    a = ap.parse_args(argv)
    lab = "pbup" if a.hosts <= N_HOSTS else f"pbup{a.hosts}"
    text, records = bench(a.repeat, a.keep, lab, a.hosts, a.slots, a.tree_spawn, a.before, a.follow)
    print(text)
    print("\n".join(verdicts(records)))


if __name__ == "__main__":
    main()
