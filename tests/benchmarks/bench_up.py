"""Launch overhead: `orch up` of a hello-world mpirun job against doing it by hand.

    python tests/benchmarks/bench_up.py [--repeat 3] [--keep] [--hosts 4 --slots 2]
        [--sizes 4x2,32x1,64x2] [--lab NAME] [--tree-spawn default|off|both] [--follow] [--before SRC]

N lab hosts x S ranks (default 4 x 2, lab `pbup`; other sizes lab `pbupN`; --sizes runs several
sizes in turn on one lab of the largest), job `echo hello` under mpirun.

- orch:   `orch up FILE -q` (--follow: without -q, rank 0's output followed): checks, render +
          distribute (hostfile), launch, follow, gather every rank's log into .orch/runs/<id>/logs;
- manual: what one types without orch: `ssh head mpirun --allow-run-as-root -H a:2,b:2,c:2,d:2
          -np 8 --bind-to none --output-filename DIR/log_output echo hello`, then `ssh host tar c
          log_output | tar x` from every host at once. Its own workdir (orch's makes log_output a
          link to its latest run) and a new output directory each time (no earlier run's file counts).

--tree-spawn off: both pass `-mca plm_rsh_no_tree_spawn 1` (every ssh from the launch host,
as orch's render does above 64 hosts); `both` measures with and without it, alternating.

Reported: median wall time, controller CPU, SSH connections each host accepted from the
controller, commands (round trips) each host ran for it, and every rank's log was gathered; and
the mpirun step on its own: orch's attempt (from its start to its end, as the launch host's
supervisor recorded them in state.json, read after the run) beside the hand-run's `ssh head
mpirun` alone, and when orch's first rank started (its wrapper's record) after the attempt did.
Targets (issue 25): orch / manual <= 1.3 at 4 x 2, <= 1.2 at 32 x 1 and 64 x 2; 1 connection per host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    ORCH, SshdCounter, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, ssh_base, table,
    write_cluster,
)
from orchestrator.runs import by_start  # the checkout: benchlib puts it on sys.path

N_HOSTS, SLOTS = 4, 2
WORKDIR = "/data/benchup"
MANUAL_WORKDIR = "/data/benchup-manual"
NO_TREE_SPAWN = ["-mca", "plm_rsh_no_tree_spawn", "1"]


def run_orch(cluster: Path, cwd: Path, n_ranks: int, src: str | None, follow: bool, head, counter: SshdCounter):
    """`orch up`; then its connections and round trips counted (`counter`, started before it) and
    only then the head's record of the attempt read (that ssh is this benchmark's, not orch's)."""
    env = base_env(src)   # src: another copy of the package (--before) in place of this tree's
    m = measure(ORCH + ["up", str(cluster)] + ([] if follow else ["-q"]), env=env, cwd=cwd, timeout=600)
    ids = by_start(cwd / ".orch" / "runs")   # the latest as `orch status` takes it
    logs = cwd / ".orch" / "runs" / ids[-1] / "logs" if ids else None
    complete = logs is not None and all(
        (logs / f"rank.{r}" / "stdout").read_bytes() == b"hello\n" for r in range(n_ranks))
    counted = counter.from_controller(), counter.sessions_from_controller()
    times = attempt_times(head, logs.parent.name) if logs is not None else {}
    return m, complete, times, counted


def attempt_times(head, run_id: str) -> dict:
    """The attempt as the launch host's supervisor recorded it (its state.json, read after the run,
    outside the measured time): `attempt` its start to its end, `first_rank` / `last_rank` when the
    first / last rank's wrapper started, after the attempt did."""
    got = subprocess.run(ssh_base(head) + [head.address, f"cat {WORKDIR}/.orch/{run_id}/state.json"],
                         capture_output=True, timeout=60)
    try:
        doc = json.loads(got.stdout)
        att = doc["attempts"][0]
        starts = sorted(r["start"] for r in doc["ranks"] if r.get("start"))
        return {"attempt": att["end"] - att["start"], "first_rank": starts[0] - att["start"] if starts else None,
                "last_rank": starts[-1] - att["start"] if starts else None}
    except (ValueError, KeyError, IndexError, TypeError):
        return {}


def run_manual(hosts, slots: int, dest: Path, out_name: str = "log_output", mca: list[str] = ()):
    head = hosts[0]
    spec = ",".join(f"{h.address}:{slots}" for h in hosts)
    out = f"{MANUAL_WORKDIR}/{out_name}"
    mpirun = (f"rm -rf {out} && mkdir -p {MANUAL_WORKDIR} && cd {MANUAL_WORKDIR} && mpirun --allow-run-as-root {shlex.join(mca)} -H {spec} "
              f"-np {len(hosts) * slots} --bind-to none --output-filename {out} echo hello")
    fetch = []
    for h in hosts:
        d = dest / h.name
        d.mkdir(parents=True, exist_ok=True)
        fetch.append(f"{shlex.join(ssh_base(h))} {h.address} {shlex.quote(f'cd {MANUAL_WORKDIR} && tar c {out_name}')} "
                     f"| tar x -C {shlex.quote(str(d))} &")
    # two steps, as typed: mpirun (its time alone reported beside orch's attempt), then the logs back
    run = measure(ssh_base(head) + [head.address, mpirun], env=base_env(), timeout=600)
    back = measure(["sh", "-c", "\n".join(fetch) + "\nwait"], env=base_env(), timeout=600)
    m = replace(back, wall=run.wall + back.wall, cpu=run.cpu + back.cpu, rc=run.rc or back.rc)
    got = 0
    for h in hosts:
        got += sum(1 for p in (dest / h.name / out_name / "1").glob("rank.*/stdout")
                   if p.read_bytes() == b"hello\n")
    return m, got == len(hosts) * slots, {"attempt": run.wall}


def bench(repeat: int, keep: bool, lab_name: str = "pbup", n_hosts: int = N_HOSTS, slots: int = SLOTS,
          tree_spawn: str = "default", before: str | None = None, follow: bool = False,
          sizes: list[tuple[int, int]] | None = None):
    """Each of `sizes` (default: n_hosts x slots) in turn, on one lab of the largest."""
    sizes = sizes or [(n_hosts, slots)]
    lab = lab_up(lab_name, max(n for n, _ in sizes))
    texts, records = [], []
    try:
        for n, k in sizes:
            text, recs = bench_size(lab, repeat, n, k, tree_spawn, before, follow)
            texts.append(text)
            records += recs
    finally:
        if not keep:
            lab.down()
    return "\n\n".join(texts) + f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", records


def bench_size(lab, repeat: int, n_hosts: int, slots: int, tree_spawn: str, before: str | None, follow: bool):
    hosts = lab_hosts([lab], n_hosts)
    variants = {"default": [""], "off": ["no-tree"], "both": ["", "no-tree"]}[tree_spawn]
    kinds = ("orch", "manual") + (("before",) if before else ())
    tools = [f"{t}{'+' + v if v else ''}" for v in variants for t in kinds]
    samples: dict[str, list] = {t: [] for t in tools}
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
                    m, complete, times, (conns, trips) = run_orch(
                        clusters[v], work, n_hosts * slots, before if tool.startswith("before") else None, follow,
                        hosts[0], counter)
                else:
                    n += 1
                    m, complete, times = run_manual(hosts, slots, work / f"manual{n}", f"log_output{n_hosts}x{slots}.{n}",
                                                    NO_TREE_SPAWN if v else [])
                    conns = counter.from_controller()
                    trips = counter.sessions_from_controller()
                samples[tool].append((m, complete, conns, trips, times))
                print(f"  up {n_hosts}x{slots} {tool:14s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:5.2f}s "
                      f"rc {m.rc} mpirun/attempt {fmt(times.get('attempt'), 's')} first rank at "
                      f"{fmt(times.get('first_rank'), 's')} conns/host {conn_summary(conns)} round trips/host "
                      f"{conn_summary(trips)} complete={complete} (load {os.getloadavg()[0]:.2f})",
                      file=sys.stderr, flush=True)
    rows, records = [], []
    for tool, s in samples.items():
        rec = {"bench": "up", "tool": tool, "hosts": n_hosts, "slots": slots,
               "wall_s": median([m.wall for m, *_ in s]), "cpu_s": median([m.cpu for m, *_ in s]),
               "attempt_s": median([t.get("attempt") for *_, t in s]),
               "first_rank_s": median([t.get("first_rank") for *_, t in s]),
               "last_rank_s": median([t.get("last_rank") for *_, t in s]),
               "conns_per_host": conn_summary([c for _, _, cs, _, _ in s for c in cs]),
               "trips_per_host": conn_summary([c for _, _, _, ts, _ in s for c in ts]),
               "complete": all(c and m.rc == 0 for m, c, *_ in s), "walls": [round(m.wall, 2) for m, *_ in s],
               "attempts": [round(t["attempt"], 2) for *_, t in s if t.get("attempt") is not None]}
        records.append(rec)
    by_tool = {r["tool"]: r for r in records}
    for r in records:
        rows.append([f"{n_hosts}x{slots}", r["tool"], fmt(r["wall_s"], " s"), fmt(r["cpu_s"], " s"),
                     fmt(r["attempt_s"], " s"),
                     f"{fmt(r['first_rank_s'], ' s')} / {fmt(r['last_rank_s'], ' s')}" if r["first_rank_s"] else "-",
                     r["conns_per_host"], r["trips_per_host"], "yes" if r["complete"] else "NO",
                     " ".join(f"{w:.2f}" for w in r["walls"]), " ".join(f"{w:.2f}" for w in r["attempts"])])
    text = table(["hosts x ranks", "how", "wall (median)", "CPU", "mpirun alone (orch: its attempt)",
                  "first / last rank started", "conns/host", "round trips/host", "all logs back", "walls",
                  "mpirun alone, each"], rows)
    for v in variants:
        o, h = by_tool[f"orch{'+' + v if v else ''}"], by_tool[f"manual{'+' + v if v else ''}"]
        ratio = o["wall_s"] / h["wall_s"]
        step = o["attempt_s"] / h["attempt_s"] if o["attempt_s"] and h["attempt_s"] else None
        text += (f"\norch / manual{' (' + v + ')' if v else ''} = {ratio:.2f} (target <= {target(n_hosts, slots):g}); "
                 f"the mpirun step alone: orch's attempt / the hand-run's mpirun = {fmt(step)}")
        records.append({"bench": "up", "ratio": ratio, "step_ratio": step, "variant": v or "default",
                        "hosts": n_hosts, "slots": slots})
        if before:
            b = by_tool[f"before{'+' + v if v else ''}"]["wall_s"] / h["wall_s"]
            text += f"\nbefore ({before}) / manual{' (' + v + ')' if v else ''} = {b:.2f}"
    return text, records


TARGETS = {(4, 2): 1.3, (32, 1): 1.2, (64, 2): 1.2}   # issue 25's


def target(n_hosts: int, slots: int = SLOTS) -> float:
    """orch up / the hand-run: issue 25's targets (4 x 2: 1.3; 32 x 1 and 64 x 2: 1.2); other
    sizes: 1.3 up to 4 hosts, else 1.2."""
    return TARGETS.get((n_hosts, slots), 1.3 if n_hosts <= N_HOSTS else 1.2)


def verdicts(records) -> list[str]:
    out = []
    for r in records:
        if "ratio" in r:
            goal = target(r["hosts"], r["slots"])
            what = "" if r["variant"] == "default" else f" ({r['variant']})"
            out.append(f"{'MET ' if r['ratio'] <= goal else 'MISS'} orch up / manual{what} <= {goal:g} "
                       f"({r['hosts']}x{r['slots']}): {r['ratio']:.2f} (the mpirun step alone: {fmt(r['step_ratio'])})")
    for o in (r for r in records if r.get("tool", "").startswith("orch")):
        out.append(f"{'MET ' if o['conns_per_host'] == '1' else 'MISS'} {o['tool']} ({o['hosts']}x{o['slots']}): "
                   f"1 connection per host: {o['conns_per_host']}")
    return out


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """"4x2,32x1,64x2" -> [(4, 2), (32, 1), (64, 2)]."""
    out = []
    for part in text.split(","):
        n, _, k = part.strip().partition("x")
        if not (n.isdigit() and k.isdigit()):
            raise argparse.ArgumentTypeError(f"{part!r}: a size is HOSTSxRANKS, e.g. 64x2")
        out.append((int(n), int(k)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--hosts", type=int, default=N_HOSTS)
    ap.add_argument("--slots", type=int, default=SLOTS)
    ap.add_argument("--sizes", type=parse_sizes, default=None, metavar="NxS,...",
                    help="several sizes in turn on one lab, e.g. 4x2,32x1,64x2 (issue 25's three)")
    ap.add_argument("--lab", default=None, help="the lab's name (default pbup, pbupN above 4 hosts)")
    ap.add_argument("--tree-spawn", choices=("default", "off", "both"), default="default")
    ap.add_argument("--follow", action="store_true", help="`orch up` as typed: rank 0's output followed (no -q)")
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also run `orch up` from this copy of the package (a before/after comparison)")
    a = ap.parse_args(argv)
    most = max(n for n, _ in a.sizes) if a.sizes else a.hosts
    lab = a.lab or ("pbup" if most <= N_HOSTS else f"pbup{most}")
    text, records = bench(a.repeat, a.keep, lab, a.hosts, a.slots, a.tree_spawn, a.before, a.follow, a.sizes)
    print(text)
    print("\n".join(verdicts(records)))


if __name__ == "__main__":
    main()
