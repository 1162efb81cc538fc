"""Every benchmark, one table each, and the targets met or missed.

    python tests/benchmarks/run_all.py [--repeat 3] [--keep] [--json results.json]
        [--only check,up,gather,fanout,plan,startup,sync,supervision,slurm,jump,scale,spares,relay,status,sessions,
                scale128]

Needs root and the lab (orch lab: network namespaces, sshd, openmpi-bin); the baselines need
`pdsh` (apt) and `ansible-core` in a separate venv (default /opt/orch-bench-venv, or
ORCH_BENCH_VENV), e.g.:

    apt-get install -y pdsh
    python3 -m venv /opt/orch-bench-venv && /opt/orch-bench-venv/bin/pip install ansible-core

A missing baseline is left out of the tables, not faked. Labs are named pb*: pbchk (64 hosts),
pbup (4), pbgat (4), pbfa + pbfb (128 each), pbsc128 (128), pbrelay (8, plus a controller
namespace shaped with `tc`); each is removed after its benchmark unless --keep.
Numbers are medians of --repeat runs; every host is on this machine, so the hosts' sshd and
probes share its cores with the controller. The last six (bench_startup, bench_sync,
bench_supervision, bench_slurm, bench_jump, and bench_check at 64/128/256 hosts on two labs,
pbchk + pbchk2) run as scripts and print their own tables; the Slurm one needs slurm-wlm and
munge (scripts/test.sh installs them). Takes about 45 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402 - once sys.path holds this directory


def plan_bench() -> tuple[str, list[dict], list[str]]:
    out = subprocess.run([sys.executable, str(HERE / "bench_plan.py")], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    rows, records, verdicts = [], [], []
    for m in re.finditer(r"^(\d+) hosts x 8 = (\d+) ranks \(target ([\d.]+) s\)\n(.*?)(?=^\d+ hosts|\Z)", out,
                         re.M | re.S):
        hosts, ranks, target, body = int(m.group(1)), int(m.group(2)), float(m.group(3)), m.group(4)
        core = float(re.search(r"plan \+ renders\s+([\d.]+) ms", body).group(1)) / 1000
        total = float(re.search(r"total incl. plan_files\s+([\d.]+) ms", body).group(1)) / 1000
        records.append({"bench": "plan", "hosts": hosts, "ranks": ranks, "plan_renders_s": core, "total_s": total})
        rows.append([f"{hosts} x 8", str(ranks), f"{core:.2f} s", f"{total:.2f} s", f"< {target:g} s"])
        verdicts.append(f"{'MET ' if core < target else 'MISS'} plan + render of {hosts} x 8 < {target:g} s: "
                        f"{core:.2f} s (with `orch plan --out` files: {total:.2f} s)")
    return benchlib.table(["hosts", "ranks", "plan + renders", "incl. plan_files", "target"], rows), records, verdicts


SCRIPTS = {  # name: (title, the script, argv after it); each prints its own table and verdicts
    "startup": ("6. Start-up before the first connection (bench_startup.py)", "bench_startup.py", ["--repeat", "15"]),
    "sync": ("7. Code sync: 3,000 files + 20 MB to 8 hosts vs parallel rsync (bench_sync.py)", "bench_sync.py", []),
    "supervision": ("8. Supervision: fail-fast and following (bench_supervision.py)", "bench_supervision.py", []),
    "slurm": ("9. First rank running: through Slurm vs over SSH (bench_slurm.py)", "bench_slurm.py", ["4"]),
    "jump": ("10. 32 hosts directly vs through one bastion (bench_jump.py)", "bench_jump.py", []),
    "scale": ("11. orch check at 64/128/256 hosts vs pdsh-c25519, processes past 128 hosts, projected to 1,000 "
              "(bench_check.py --sizes 64,128,256)", "bench_check.py",
              ["--sizes", "64,128,256", "--tools", "orch,pdsh-c25519"]),
    "spares": ("12. Spare hosts: what they cost orch up and the configs, and the head's replacement "
               "(bench_spares.py)", "bench_spares.py", []),
    "relay": ("13. Code sync over a 50 Mbit/s controller link: through the launch host vs direct vs parallel "
              "rsync (bench_sync_relay.py)", "bench_sync_relay.py", []),
    "status": ("14. `orch status` of an ended run at 32 hosts: wall, CPU, connections per host (bench_status.py)",
               "bench_status.py", ["32"]),
    "sessions": ("15. SSH sessions per host of one `orch up -q` at 4 hosts x 2 ranks, mpirun and ranktable "
                 "(bench_sessions.py)", "bench_sessions.py", ["4"]),
    "scale128": ("16. Start-up at scale: `orch up -q` at 128 hosts x 8 ranks (ranktable, 5 s job) vs pdsh + ssh tar "
                 "with curve25519, by steps (bench_scale.py)", "bench_scale.py", ["128"]),
    "idle": ("17. A live run's supervisors while its ranks say nothing: CPU a second, head and members, at 128 hosts "
             "x 8 ranks (bench_idle.py)", "bench_idle.py", ["128"]),
}


def script_bench(name: str, repeat: int) -> str:
    _, script, argv = SCRIPTS[name]
    argv = [*argv]
    if name in ("sync", "jump", "scale", "scale128"):
        argv += ["--repeat", str(repeat)]
    res = subprocess.run([sys.executable, str(HERE / script), *argv], capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        return f"({script} failed, exit {res.returncode}: {res.stderr.strip()[-1500:]})"
    return res.stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="check,up,gather,fanout,plan," + ",".join(SCRIPTS))
    ap.add_argument("--keep", action="store_true", help="leave the labs up")
    ap.add_argument("--json", default=None, help="also write every number to this file")
    a = ap.parse_args(argv)
    only = a.only.split(",")
    t0 = time.monotonic()
    sections: list[tuple[str, str, list[str]]] = []
    records: list[dict] = []
    print(f"# orch benchmarks ({platform.node()}, {platform.machine()}, "
          f"{len(__import__('os').sched_getaffinity(0))} CPUs, Python {platform.python_version()}; "
          f"median of {a.repeat})", flush=True)
    if "check" in only:
        import bench_check
        text, recs = bench_check.bench([8, 32, 64], a.repeat, a.keep)
        sections.append(("1. Preflight at scale: `orch check` vs pdsh vs Ansible (same probe)", text,
                         bench_check.verdicts(recs)))
        records += recs
    if "up" in only:
        import bench_up
        text, recs = bench_up.bench(a.repeat, a.keep)
        sections.append(("2. Launch overhead: `orch up` vs by hand (ssh head mpirun + tar back)", text,
                         bench_up.verdicts(recs)))
        records += recs
    if "gather" in only:
        import bench_gather
        text, recs = bench_gather.bench(50, a.repeat, a.keep)
        sections.append(("3. Log gathering: 4 hosts x 4 ranks x 50 MB", text, bench_gather.verdicts(recs)))
        records += recs
    if "plan" in only:
        text, recs, verdicts = plan_bench()
        sections.append(("4. Plan/render (tests/benchmarks/bench_plan.py)", text, verdicts))
        records += recs
    if "fanout" in only:
        import bench_fanout
        text, recs = bench_fanout.bench([64, 128, 256], max(1, a.repeat - 1), a.keep)
        sections.append(("5. Fan-out to 256 hosts (two labs of 128; `orch check`, mesh skipped)", text, []))
        records += recs
    for name, (title, _, _) in SCRIPTS.items():
        if name in only:
            sections.append((title, script_bench(name, a.repeat), []))
    for title, text, verdicts in sections:
        print(f"\n## {title}\n\n{text}\n")
        for v in verdicts:
            print(v)
    print(f"\n(all benchmarks: {time.monotonic() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
