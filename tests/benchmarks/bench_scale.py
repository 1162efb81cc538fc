"""Start-up at scale: `orch up -q` of N hosts x 8 ranks (default 128 x 8 = 1,024) against the
hand-run, side by side in one run (issue 25 item 3).

    python tests/benchmarks/bench_scale.py [N] [--repeat 3] [--keep] [--lab NAME] [--before SRC]

The job: launcher `ranktable` (Ascend rank table; the lab hosts have /etc/hccn.conf), 8 ranks a
host, each `echo` then `sleep 5`.

- orch:   `orch up FILE -q`; a first run syncs (not measured), then --repeat runs with nothing
          changed, each timed by steps from timestamps: the orch process runs in-process under a
          small driver that notes the wall clock around each of the lifecycle's steps (check,
          prepare + render, sync, supervisors started, follow, gather) and when each host's
          supervisor start answered (the start step holds the sync: the supervisors' starts go
          out first and wait for it; before that change, the sync came before the start step);
          the head's document (run.json's attempts) says when every host had joined and the
          ranks were started, each member's agent.json (rewritten when it joins the head) when
          that member joined, the head's state.json when the last rank started and ended (each
          as its host reported it);
- hand:   `pdsh -f N` with orch's key exchange (`-o KexAlgorithms=curve25519-sha256`) starting
          the 8 ranks on every host (each its log file) and waiting for them, then
          `ssh host tar c logs | tar x` from every host at once.

Reported: medians of the walls, orch / hand (target <= 1.1), every step's median, and verdicts:
the no-change sync step < 0.5 s, the supervisors started and joined < 2 s, the gather of the
1,024 logs < 1 s. Lab `pbsc<N>` (or --lab), removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ROOT, base_env, fmt, lab_hosts, lab_up, measure, median, pdsh_available, pdsh_env, ssh_base, table, write_cluster
from orchestrator.agent.layout import INFO, STATE
from orchestrator.runs import by_start

SLOTS = 8
SLEEP = 5
KEX = "-o KexAlgorithms=curve25519-sha256"
WORKDIR = "/data/bench-scale"     # --before's runs: WORKDIR-before (its own: each tree's files stay as it left them)
HAND_WORKDIR = "/data/bench-scale-hand"

# `orch up` in this process, the wall clock noted around the lifecycle's steps: a JSON list of
# [what, time.time()] in $ORCH_BENCH_STEPS at exit
DRIVER = r"""
import atexit, json, os, sys, threading, time
T0 = time.time()
from orchestrator import checks, cli, lifecycle, supervisor
marks = [["begin", T0, time.process_time()]]
lock = threading.Lock()
def mark(what):
    with lock:
        marks.append([what, time.time(), time.process_time()])
def wrap(owner, name, label):
    real = getattr(owner, name)
    def f(*a, **k):
        mark(label + " begin")
        try:
            return real(*a, **k)
        finally:
            mark(label + " end")
    setattr(owner, name, f)
wrap(checks, "run_checks", "check")
for name in ("distribute", "start", "follow", "gather", "finish"):
    wrap(lifecycle.Lifecycle, name, name)
from orchestrator import runs
wrap(runs.Run, "save", "save")
real_parse = supervisor.parse_start
def parse_start(text):   # called as each host's supervisor start answers (the head's first)
    mark("started host")
    return real_parse(text)
supervisor.parse_start = parse_start
atexit.register(lambda: open(os.environ["ORCH_BENCH_STEPS"], "w").write(json.dumps(
    marks + [["exit", time.time(), time.process_time()]])))
sys.argv = ["orch"] + sys.argv[1:]
cli.main()
"""


def job_command() -> list[str]:
    return ["sh", "-c", f'echo "rank $RANK_ID device $DEVICE_ID"; sleep {SLEEP}']


def run_orch(cluster: Path, cwd: Path, hosts, src: str, workdir: str) -> dict:
    steps = cwd / "steps.json"
    env = base_env(src, ORCH_BENCH_STEPS=steps)
    m = measure([sys.executable, "-c", DRIVER, "up", str(cluster), "-q"], env=env, cwd=cwd, timeout=900)
    m.check("orch up")
    marks = json.loads(steps.read_text())
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    cpu: dict[str, float] = {}    # the controller's CPU (its main process) at each step's last mark
    for what, t, c in marks:
        first.setdefault(what, t)
        last[what] = t
        cpu.setdefault(what, c)
        cpu[what + " last"] = c
    latest = cwd / ".orch" / "runs" / by_start(cwd / ".orch" / "runs")[-1]   # as `orch status` takes it
    run = json.loads((latest / "run.json").read_text())
    att = (run.get("attempts") or [{}])[0]
    logs = latest / "logs"
    complete = sum(1 for r in range(len(hosts) * SLOTS)
                   if (logs / f"rank.{r}" / "stdout").read_bytes().startswith(f"rank {r} ".encode()))
    started = [t for what, t, _ in marks if what == "started host"]

    def in_run_dir(h, name: str) -> Path:   # the run's directory on lab host h, seen from here
        return h.lab.host_dir(h.index) / "data" / workdir.split("/data/", 1)[1] / ".orch" / run["id"] / name

    # each member's agent.json is rewritten as it joins the head: its mtime is the join
    joins = []
    for h in hosts[1:]:
        try:
            joins.append(in_run_dir(h, INFO).stat().st_mtime)
        except OSError:
            pass
    # the head's document has every rank's start and end as its host reported them
    state = json.loads(in_run_dir(hosts[0], STATE).read_text())
    starts = [r["start"] for r in state["ranks"] if r.get("start")]
    ends = [r["end"] for r in state["ranks"] if r.get("end")]
    s = first["start begin"]
    out = {
        "wall": m.wall, "cpu": m.cpu, "complete": complete,
        "python start": first["check begin"] - first["begin"],
        "check": last["check end"] - first["check begin"],
        "prepare + render": first["distribute begin"] - last["check end"],
        "sync": last["distribute end"] - first["distribute begin"],
        "head started": started[0] - s if started else None,
        "members started": started[-1] - s if started else None,
        "all joined": max(joins) - s if joins else None,
        "first join": min(joins) - s if joins else None,
        "ranks started": (att.get("start") or 0) - s if att.get("start") else None,
        "last rank started": max(starts) - s if starts else None,
        "last rank ended": max(ends) - s if ends else None,
        "start step": last["start end"] - s,
        "run (ranks started -> follow end)": last["follow end"] - att["start"] if att.get("start") else None,
        "follow": last["follow end"] - first["follow begin"],
        "last rank ended -> follow end": last["follow end"] - max(ends) if ends else None,
        "gather": last["gather end"] - first["gather begin"],
        "finish + gather": last["exit"] - last["follow end"],
    }
    out["started and joined"] = out["ranks started"]
    # run.json written during the start step (after the head's start, after the members')
    saves = [t for what, t, _ in marks if what in ("save begin", "save end")]
    pairs = [(a, b) for a, b in zip(saves[::2], saves[1::2]) if s <= a and b <= last["start end"]]
    out["run.json saves in start"] = sum(b - a for a, b in pairs)
    out.update({"cpu: check": cpu["check end last"] - cpu["check begin"],
                "cpu: sync": cpu["distribute end last"] - cpu["distribute begin"],
                "cpu: start": cpu["start end last"] - cpu["start begin"],
                "cpu: follow": cpu["follow end last"] - cpu["follow begin"],
                "cpu: gather": cpu["gather end last"] - cpu["gather begin"]})
    return out


def run_hand(hosts, dest: Path, n: int) -> tuple[float, int]:
    """pdsh starts 8 ranks on every host and waits; then every host's logs come back as a tar stream."""
    d = f"{HAND_WORKDIR}/run{n}"
    ranks = " ".join(str(i) for i in range(SLOTS))
    remote = (f"rm -rf {HAND_WORKDIR} && mkdir -p {d} && cd {d} && for i in {ranks}; do mkdir -p logs/rank.$i; "
              f"DEVICE_ID=$i RANK_ID=$i sh -c {shlex.quote(job_command()[2])} > logs/rank.$i/stdout 2>&1 & "
              "done; wait")
    lab = hosts[0].lab
    env = pdsh_env(lab)
    env["PDSH_SSH_ARGS_APPEND"] += f" {KEX}"
    fetch = []
    for h in hosts:
        (dest / h.name).mkdir(parents=True, exist_ok=True)
        fetch.append(f"{shlex.join(ssh_base(h))} {KEX} {h.address} {shlex.quote(f'cd {d} && tar c logs')} "
                     f"| tar x -C {shlex.quote(str(dest / h.name))} &")
    script = (f"pdsh -R ssh -f {len(hosts)} -w {','.join(h.address for h in hosts)} {shlex.quote(remote)} "
              ">/dev/null || exit 1\n" + "\n".join(fetch) + "\nwait\n")
    m = measure(["sh", "-c", script], env=env, timeout=900).check("hand-run")
    got = sum(1 for h in hosts for i in range(SLOTS)
              if (dest / h.name / "logs" / f"rank.{i}" / "stdout").read_bytes().startswith(f"rank {i} ".encode()))
    return m.wall, got


STEPS = ["python start", "check", "prepare + render", "sync", "head started", "members started", "first join",
         "all joined", "ranks started", "last rank started", "last rank ended", "start step", "run.json saves in start",
         "run (ranks started -> follow end)", "follow", "last rank ended -> follow end", "gather", "finish + gather", "cpu: check", "cpu: sync", "cpu: start", "cpu: follow", "cpu: gather"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hosts", nargs="?", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    ap.add_argument("--lab", default=None, help="the lab's name (default pbsc<N>); an existing one is reused")
    ap.add_argument("--before", default=None, metavar="SRC", help="also time `orch up` from this copy of the package")
    ap.add_argument("--no-hand", action="store_true", help="orch only (while iterating)")
    a = ap.parse_args(argv)
    if not a.no_hand and not pdsh_available():
        print("pdsh is missing (apt-get install -y pdsh): no hand-run to compare with", file=sys.stderr)
        return 2
    lab = lab_up(a.lab or f"pbsc{a.hosts}", a.hosts)
    hosts = lab_hosts([lab], a.hosts)
    trees = [("orch", str(ROOT))] + ([("before", a.before)] if a.before else [])
    samples: dict[str, list[dict]] = {t: [] for t, _ in trees}
    hand: list[float] = []
    hand_logs: list[int] = []
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-scale-") as tmp:
            work = Path(tmp)
            dirs = {}
            workdirs = {"orch": WORKDIR, "before": WORKDIR + "-before"}
            for tree, src in trees:
                d = work / tree
                d.mkdir()
                write_cluster(d / "cluster.yaml", hosts, slots=SLOTS, ssh={"fanout": 128},
                              job={"launcher": "ranktable", "platform": "ascend", "command": job_command(),
                                   "workdir": workdirs[tree], "timeout": 300, "sync": ["train.py"]},
                              checks={"versions": ["python"]})
                (d / "train.py").write_text("print('train')\n")
                first = run_orch(d / "cluster.yaml", d, hosts, src, workdirs[tree])
                print(f"  {tree} first (syncs): wall {first['wall']:.2f}s sync {first['sync']:.2f}s "
                      f"(load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
                dirs[tree] = (d, src)
            for rep in range(a.repeat):
                order = [t for t, _ in trees] + ([] if a.no_hand else ["hand"])
                for tool in (order if rep % 2 == 0 else order[::-1]):
                    if tool == "hand":
                        wall, got = run_hand(hosts, work / f"hand{rep}", rep)
                        hand.append(wall)
                        hand_logs.append(got)
                        print(f"  hand rep {rep + 1}: wall {wall:.2f}s logs {got} (load {os.getloadavg()[0]:.2f})",
                              file=sys.stderr, flush=True)
                        continue
                    d, src = dirs[tool]
                    r = run_orch(d / "cluster.yaml", d, hosts, src, workdirs[tool])
                    samples[tool].append(r)
                    print(f"  {tool} rep {rep + 1}: " + " ".join(f"{k}={fmt(v)}" for k, v in r.items())
                          + f" (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    finally:
        if not a.keep:
            lab.down()
    n_ranks = a.hosts * SLOTS
    heads = ["step"] + [t for t, _ in trees] + ["(each run)"]
    rows = []
    for step in ["wall"] + STEPS:
        cells = [step]
        for tool, _ in trees:
            cells.append(fmt(median([s.get(step) for s in samples[tool]]), " s"))
        cells.append(" ".join(fmt(s.get(step)) for s in samples["orch"]))
        rows.append(cells)
    print(f"`orch up -q` at {a.hosts} hosts x {SLOTS} ranks ({n_ranks}), ranktable, each rank `echo; sleep {SLEEP}`, "
          f"nothing changed since the first run; medians of {a.repeat} (steps from the wall clock: the driver's "
          "marks, the head's attempt start, the members' join):")
    print(table(heads, rows))
    o = samples["orch"]
    wall = median([s["wall"] for s in o])
    sync = median([s["sync"] for s in o])
    joined = median([s["started and joined"] for s in o])
    gather = median([s["gather"] for s in o])
    logs_ok = all(s["complete"] == n_ranks for s in o)
    print(f"every rank's log gathered (all {a.repeat} runs): {'yes' if logs_ok else 'NO'} "
          f"({', '.join(str(s['complete']) for s in o)} of {n_ranks})")
    if hand:
        h = median(hand)
        print(f"hand-run (pdsh -f {a.hosts} {KEX} starting the ranks, waiting; then ssh tar c logs | tar x from every "
              f"host at once): {h:.2f} s (runs: {' '.join(f'{x:.2f}' for x in hand)}; logs back: "
              f"{', '.join(str(g) for g in hand_logs)} of {n_ranks})")
        ratio = wall / h
        print(f"orch / hand = {wall:.2f} / {h:.2f} = {ratio:.2f} (target <= 1.1)")
        print(f"{'MET ' if ratio <= 1.1 else 'MISS'} orch up / hand-run <= 1.1 at {a.hosts}x{SLOTS}: {ratio:.2f}")
    print(f"{'MET ' if sync < 0.5 else 'MISS'} no-change sync step < 0.5 s: {sync:.2f} s")
    print(f"{'MET ' if joined < 2 else 'MISS'} supervisors started and joined (start step begins -> the head starts "
          f"the ranks) < 2 s: {joined:.2f} s")
    print(f"{'MET ' if gather < 1 else 'MISS'} gather of {n_ranks} logs < 1 s: {gather:.2f} s")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
