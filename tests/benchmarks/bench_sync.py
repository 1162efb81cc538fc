"""Code sync inside `orch up`, against parallel `rsync -a` plus a hand-run `ssh head mpirun`.

    python tests/benchmarks/bench_sync.py [--hosts 8] [--files 3000] [--repeat 3] [--keep] [--sync-via controller]
                                          [--before SRC]

Needs root (the lab) and rsync (apt-get install rsync). A project of --files small Python
files (about 11 KB each, in 30 directories) plus a 20 MB binary, a `.git` of 200 files and a
`__pycache__` (left out by orch's defaults; by rsync's `--exclude`s), synced to --hosts lab
hosts, then a hello-world mpirun (1 rank per host):

- orch:   `orch up -q --skip-checks` (and `orch up -q`, preflight included);
- manual: `rsync -a --exclude .git --exclude __pycache__` to every host at once, then
          `ssh head mpirun -H ... echo hello`;
- before: with --before SRC (a checkout of another orch, `git archive REV | tar -x -C SRC`),
          its `orch up -q --skip-checks`, in the same runs.

Each is measured on a first sync (into a new, empty workdir on every host: one of its own per
tool and repetition) and on a re-run with nothing changed; medians of --repeat alternating runs.
The workdirs are removed at the end, not between runs: every lab host's /data is a directory of
this machine's one filesystem, and where that is ext4 without a journal (this machine's) a file
created within a minute of ~24,000 deletions (minutes, while their inode table blocks are dirty)
costs the kernel a scan past every recently deleted inode of its group (find_inode_bit ->
recently_deleted: 28-37% of all the machine's CPU in a first sync that followed an `rm -rf` of
the last one, for orch and rsync alike, by `perf record -a -g`), which made the first-sync ratio
the kernel's, varying by seconds from run to run. A run started within minutes of a removal (the
last run's, or leftovers removed at the start) still pays it in its first repetitions. Disk:
~53 MB a host for each first sync (3 tools x --repeat x --hosts: ~3.8 GB at the defaults; 4 with --before).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ORCH, base_env, fmt, lab_hosts, lab_up, measure, median, ssh_base, table, write_cluster

WORKDIR = "/data/benchsync"


def project(root: Path, files: int) -> Path:
    proj = root / "proj"
    for i in range(files):
        d = proj / f"pkg{i % 30}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 1800)
    (proj / "weights.bin").write_bytes(os.urandom(20 << 20))
    for i in range(200):
        (proj / ".git" / "objects").mkdir(parents=True, exist_ok=True)
        (proj / ".git" / "objects" / f"o{i}").write_bytes(os.urandom(512))
    (proj / "__pycache__").mkdir()
    (proj / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0" * 4096)
    return proj


def clean(hosts) -> None:
    for h in hosts:
        h.lab.exec(h.index, ["rm", "-rf", WORKDIR])


def manual(hosts, proj: Path, workdir: str):
    ssh = shlex.join(ssh_base(hosts[0]))
    rsyncs = [f"rsync -a --exclude .git --exclude __pycache__ -e {shlex.quote(ssh)} {shlex.quote(str(proj))} "
              f"root@{h.address}:{workdir}/ &" for h in hosts]
    spec = ",".join(f"{h.address}:1" for h in hosts)
    mpirun = f"mkdir -p {workdir} && cd {workdir} && mpirun --allow-run-as-root -H {spec} -np {len(hosts)} echo hello"
    prep = " ".join(f"{ssh} {h.address} mkdir -p {workdir} &" for h in hosts)
    script = f"{prep} wait\n" + "\n".join(rsyncs) + "\nwait\n" + f"{ssh} {hosts[0].address} {shlex.quote(mpirun)} >/dev/null"
    return measure(["sh", "-c", script], env=base_env(), timeout=600)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--sync-via", choices=["controller", "launch-host"], default=None,
                    help="job.sync_via (default: orch's, launch-host for mpirun)")
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also `orch up -q --skip-checks` of the orch package in SRC (a checkout)")
    a = ap.parse_args(argv)
    lab = lab_up("pbsync", a.hosts)
    hosts = lab_hosts([lab], a.hosts)
    samples: dict[tuple[str, str], list] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-sync-") as tmp:
            work = Path(tmp)
            proj = project(work, a.files)
            clean(hosts)  # a run before this one's (removing it may slow the first runs, see above)
            # each orch's `orch up` options, the name of its workdirs and its source (None: this tree)
            orchs = {"orch --skip-checks": (["--skip-checks"], "orch-skip", None),
                     "orch (with preflight)": ([], "orch-checked", None),
                     **({"before --skip-checks": (["--skip-checks"], "before-skip", a.before)} if a.before else {})}
            for rep in range(a.repeat):
                order = ["manual", *orchs] if rep % 2 == 0 else [*orchs, "manual"]
                for tool in order:
                    options, name, src = orchs.get(tool, (None, tool, None))
                    workdir = f"{WORKDIR}/{name}-{rep + 1}"
                    if options is not None:
                        cluster = write_cluster(work / "sync.yaml", hosts, slots=1, job={
                            "workdir": workdir, "command": ["echo", "hello"], "launcher": "mpirun",
                            "sync": [str(proj)], **({"sync_via": a.sync_via} if a.sync_via else {})},
                            checks={"versions": ["python", "openmpi"]})
                    for phase in ("first", "unchanged"):
                        m = manual(hosts, proj, workdir) if options is None else measure(
                            ORCH + ["up", str(cluster), "-q", *options], env=base_env(src), cwd=work, timeout=600)
                        assert m.rc == 0, (tool, m.stderr[-2000:])
                        samples.setdefault((tool, phase), []).append(m)
                        print(f"  {tool:22s} {phase:9s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:5.2f}s "
                              f"machine {m.machine_cpu:5.2f}s", file=sys.stderr, flush=True)
    finally:
        try:
            clean(hosts)
        finally:
            if not a.keep:
                lab.down()
    rows = []
    for (tool, phase), ms in samples.items():
        rows.append([tool, phase, fmt(median([m.wall for m in ms]), " s"), fmt(median([m.cpu for m in ms]), " s"),
                     fmt(median([m.machine_cpu for m in ms]), " s"), " ".join(f"{m.wall:.2f}" for m in ms)])
    rows.sort(key=lambda r: (r[1], r[0]))
    print(f"{a.files} files + a 20 MB binary to {a.hosts} lab hosts, then mpirun hello ({os.cpu_count()} cores; "
          "machine CPU: all of this machine's, the lab hosts' included):")
    print(table(["how", "sync", "wall (median)", "controller CPU", "machine CPU", "walls"], rows))
    for phase in ("first", "unchanged"):
        man = median([m.wall for m in samples[("manual", phase)]])
        o = median([m.wall for m in samples[("orch --skip-checks", phase)]])
        print(f"{phase}: orch --skip-checks / manual = {o / man:.2f} (target <= 1.0)"
              + (f"; before {median([m.wall for m in samples[('before --skip-checks', phase)]]) / man:.2f}"
                 if a.before else ""))


if __name__ == "__main__":
    main()
