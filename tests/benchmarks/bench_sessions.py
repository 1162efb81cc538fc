"""SSH sessions per host of one `orch up -q` (issue 25 item 1: one conversation per host).

    python tests/benchmarks/bench_sessions.py [N]     (root: makes its own N-host lab, default 4)
    ORCH_BENCH_BEFORE=DIR python tests/benchmarks/bench_sessions.py   (and another copy side by side,
        e.g. `git archive main orchestrator | tar -x -C DIR`)

A short job (`true`) at N hosts x 2 ranks, mpirun and ranktable, with the preflight checks and
with --skip-checks, each run once more with nothing changed. Counted on the hosts' side, from
each lab host's sshd log (LogLevel VERBOSE) since just before the `orch up`: connections
accepted from this machine ("Accepted publickey") and sessions (one per command, "Starting
session"), per host; and, in the `orch up` process itself, which of orch's functions opened each
session (the transport's _exec wrapped: the first caller outside the transport and the fan-out).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ROOT, Lab, base_env, SshdCounter, lab_hosts, measure, table, write_cluster

# `orch up` in this process, each SSH session (SshTransport._exec) recorded with the orch function
# that asked for it: {host: [function, ...]} as JSON in $ORCH_BENCH_SESSIONS at exit
DRIVER = r"""
import atexit, collections, json, os, sys, threading
from orchestrator.transport import ssh
from orchestrator import cli
SKIP = ("orchestrator/transport/", "orchestrator/fanout.py", "orchestrator/shards.py", "concurrent/", "threading.py")
got = collections.defaultdict(list)
lock = threading.Lock()
real = ssh.SshTransport._exec
def _exec(self, *a, **k):
    f = sys._getframe(1)
    while f is not None and (any(x in f.f_code.co_filename for x in SKIP) or "orchestrator/" not in f.f_code.co_filename):
        f = f.f_back
    where = "?" if f is None else f.f_code.co_filename.split("orchestrator/")[-1][:-3] + "." + f.f_code.co_name
    with lock:
        got[self.host.name].append(where)
    return real(self, *a, **k)
ssh.SshTransport._exec = _exec
atexit.register(lambda: open(os.environ["ORCH_BENCH_SESSIONS"], "w").write(json.dumps(got)))
sys.argv = ["orch"] + sys.argv[1:]
cli.main()
"""


def up_once(d: Path, hosts, argv: list[str], src: str) -> tuple[list[int], list[int], float, dict]:
    counter = SshdCounter(hosts).start()
    log = d / "sessions.json"
    m = measure([sys.executable, "-c", DRIVER, "up", "-q", *argv],
                env=base_env(src, ORCH_BENCH_SESSIONS=log), cwd=d
                ).check("orch up " + " ".join(argv))
    got = counter.counts()
    conns = [got[h.name][h.controller] for h in hosts]
    return conns, counter.sessions_from_controller(), m.wall, json.loads(log.read_text())


def main(n: int) -> None:
    lab = Lab(f"bses{os.getpid() % 10000}")
    lab.up(n)
    rows, steps = [], []
    try:
        hosts = lab_hosts([lab], n)
        trees = [("this tree", str(ROOT))]
        if os.environ.get("ORCH_BENCH_BEFORE"):
            trees.insert(0, ("before", os.environ["ORCH_BENCH_BEFORE"]))
        for (tree, src), launcher in itertools.product(trees, ("mpirun", "ranktable")):
            for flags in ([], ["--skip-checks"]):
                with tempfile.TemporaryDirectory() as tmp:
                    d = Path(tmp)
                    (d / "train.py").write_text("print('hello')\n")
                    write_cluster(d / "cluster.yaml", hosts, slots=2,
                                  job={"launcher": launcher, "command": "true", "sync": ["train.py"],
                                       "workdir": f"/data/bench-sessions-{launcher}-{len(rows)}"})
                    for what in ("first", "no change"):
                        conns, sessions, wall, by = up_once(d, hosts, flags, src)
                        steps.append((f"{tree}, {launcher}, {' '.join(flags) or 'checks'}, {what}",
                                      {h.name: by.get(h.name, []) for h in hosts[:2]}))
                        rows.append([tree, launcher, " ".join(flags) or "checks", what, f"{wall:.2f} s",
                                     " ".join(str(c) for c in conns), " ".join(str(s) for s in sessions),
                                     str(sum(sessions))])
    finally:
        lab.down()
    print(f"SSH sessions of one `orch up -q` per host, {n} lab hosts x 2 ranks, job `true` "
          f"(from each host's sshd log; hosts in inventory order, the launch host first):")
    print(table(["orch", "launcher", "preflight", "run", "wall", "connections per host", "sessions per host", "sessions"],
                rows))
    print("\nWho opened each session (orch's function), the launch host and one other host:")
    for what, per_host in steps:
        print(f"  {what}:")
        for name, fns in per_host.items():
            print(f"    {name}: {', '.join(fns) or '-'}")
    print("A session is one command (round trip); connections: logins (this machine keeps one per host).")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
