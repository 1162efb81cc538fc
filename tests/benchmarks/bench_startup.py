"""Start-up: what every `orch` invocation pays before it touches a host.

    python tests/benchmarks/bench_startup.py [--repeat 15] [--before SRC]

Targets (performance round two): `orch --version` under 0.1 s, `orch status` / `orch logs`
under 0.25 s, `orch check` before its first connection under 0.35 s. Measured here:

- the interpreter alone (`python3 -c pass`, with this environment's site-packages): the floor;
- `orch --version`;
- `orch status` and `orch logs --rank 0` of a finished run recorded in this directory (one
  local host: no SSH, so the figure is orch's own start-up plus reading the record);
- `orch check --print-probe HOST`: load and validate cluster.yaml, plan, build the probe:
  everything `orch check` does before its first connection (then it ends with os._exit, as
  every command that reports does: the interpreter's teardown is not in the figure).

Medians of --repeat runs, wall and CPU (user+sys); with --before SRC (a directory holding another
copy of `orchestrator/`, e.g. a `git archive` of an earlier commit) that copy's commands too, in
the same rotation, as a before/after comparison. Then the biggest imports of each command
(`python -X importtime`, cumulative microseconds) as the evidence of where the time goes.
Needs no lab and no root.

Bytecode is cached as on a user's machine: PYTHONDONTWRITEBYTECODE is taken out of the
commands' environment (some sandboxes set it, and then every module is compiled on every run,
which adds ~70 ms to `orch status`), and a first `orch up` writes the caches. `orch status`
asks the host (here: this machine, `connection: local`) with `python3 -S`; the directory of the
interpreter running this benchmark comes first on PATH, so that `python3` is a real interpreter as
on a cluster's hosts, not a version manager's shim (pyenv's costs ~80 ms a start).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402 - once sys.path holds this directory

TARGETS = {"orch --version": 0.10, "orch status": 0.25, "orch logs --rank 0": 0.25,
           "orch check (to first connection)": 0.35}
CLUSTER = """name: startup
inventory:
  hosts:
    - {address: 127.0.0.1, connection: local, slots: 2}
job:
  workdir: WORKDIR
  command: [sh, -c, 'echo hello from rank $RANK_ID']
  launcher: ranktable
  platform: cpu
"""


def commands(py: str) -> dict[str, list[str]]:
    orch = [py, "-m", "orchestrator.cli"]
    return {"python3 -c pass (floor)": [py, "-c", "pass"],
            "orch --version": [*orch, "--version"],
            "orch status": [*orch, "status"],
            "orch logs --rank 0": [*orch, "logs", "--rank", "0"],
            "orch check (to first connection)": [*orch, "check", "--print-probe", "127.0.0.1"]}


def top_imports(argv: list[str], cwd: str, env: dict, n: int = 6) -> list[tuple[str, float]]:
    """The `n` biggest top-level imports (cumulative ms) of one run under -X importtime."""
    res = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=60)
    rows = []
    for line in res.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)", line)
        if m and len(m.group(2)) <= 2:  # top-level (and the editable-install finder's) imports
            rows.append((m.group(3), int(m.group(1)) / 1000))
    return sorted(rows, key=lambda r: -r[1])[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also run each command from this copy of the package (a before/after comparison)")
    a = ap.parse_args(argv)
    path = os.path.dirname(os.path.realpath(sys.executable)) + os.pathsep + os.environ.get("PATH", "")
    env = {**benchlib.base_env(), "PATH": path}
    trees = {"": env} | ({"before": {**benchlib.base_env(a.before), "PATH": path}} if a.before else {})
    with tempfile.TemporaryDirectory(prefix="orch-bench-startup-") as d:
        (Path(d) / "cluster.yaml").write_text(CLUSTER.replace("WORKDIR", str(Path(d) / "wd")))
        benchlib.measure([sys.executable, "-m", "orchestrator.cli", "up", "-q"], env=env, cwd=d).check("orch up")
        cmds = commands(sys.executable)
        runs = [(name, tree) for name in cmds for tree in trees]
        for name, tree in runs:  # each tree's bytecode cached before anything is timed
            benchlib.measure(cmds[name], env=trees[tree], cwd=d).check(name)
        walls: dict[tuple, list[float]] = {k: [] for k in runs}
        cpus: dict[tuple, list[float]] = {k: [] for k in runs}
        for _ in range(a.repeat):  # alternating: a burst of load hits every command (and tree) alike
            for name, tree in runs:
                m = benchlib.measure(cmds[name], env=trees[tree], cwd=d).check(name)
                walls[name, tree].append(m.wall)
                cpus[name, tree].append(m.cpu)
        rows, verdicts = [], []
        for name in cmds:
            w, c = benchlib.median(walls[name, ""]), benchlib.median(cpus[name, ""])
            target = TARGETS.get(name)
            rows.append([name, f"{w * 1000:.0f} ms", f"{c * 1000:.0f} ms"]
                        + ([f"{benchlib.median(walls[name, 'before']) * 1000:.0f} ms",
                            f"{benchlib.median(cpus[name, 'before']) * 1000:.0f} ms"] if a.before else [])
                        + [f"< {target * 1000:.0f} ms" if target else "-"])
            if target:
                verdicts.append(f"{'MET ' if w < target else 'MISS'} {name} < {target * 1000:.0f} ms: {w * 1000:.0f} ms")
        print(f"# start-up, median of {a.repeat} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})\n")
        print(benchlib.table(["command", "wall", "CPU"] + (["before wall", "before CPU"] if a.before else [])
                             + ["target"], rows))
        if a.before:
            print(f"\n(before: orch from {a.before})")
        print()
        for v in verdicts:
            print(v)
        print("\nbiggest imports (python -X importtime, cumulative):")
        for name, cmd in cmds.items():
            if name.startswith("python3"):
                continue
            tops = ", ".join(f"{mod} {ms:.0f} ms" for mod, ms in top_imports(cmd, d, env))
            print(f"  {name}: {tops}")
        # cli.cli, not main(): the program ends `orch status` with os._exit, before this could print
        loaded = subprocess.run([sys.executable, "-c", "import sys, orchestrator.cli as c; sys.argv=['orch','status'];"
                                 "\ntry: c.cli(prog_name='orch')\nexcept SystemExit: pass\n"
                                 "print(' '.join(m for m in ('pydantic', 'paramiko', 'orchestrator.spec', 'yaml', "
                                 "'ClusterShell.NodeSet') if m in sys.modules))"],
                                cwd=d, env=env, capture_output=True, text=True, timeout=60).stdout.splitlines()
        print(f"\n`orch status` loads: {loaded[-1] if loaded else '?'} (of pydantic, paramiko, orchestrator.spec, "
              "yaml, ClusterShell.NodeSet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
