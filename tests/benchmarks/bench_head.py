"""The run's head supervisor under hostile and heavy load, and how fast a crash is cleaned up.

    python tests/benchmarks/bench_head.py            # loopback only, any user
    python tests/benchmarks/bench_head.py --lab      # also the crash on a 4-host lab (root)

The head is the real one (agent.py start --foreground, the machine's python3, as on a host) in
its own process; the attackers and members are this process. Prints:
- the head's RSS and CPU with 1,000 idle unauthenticated connections, and with 150 connections
  each sending a 1 MB line;
- the time to reject one bad connection (connect, `[]`, closed), median of 50;
- authentication per join at 128 hosts: 127 members joining at once, the head's CPU per join and
  the wall time until all have joined;
- the time from a head crash (kill -9) to the last rank of the run gone: on this machine (the
  head's own ranks) and, with --lab, on every host of a 4-host lab;
- the head's decisions (head.decide, pure) at 128 hosts x 8 ranks: CPU per turn over every
  member reporting 8 times while its ranks run, once as they end, and idle turns.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.agent import protocol as proto
from orchestrator.agent import server as S
from tests.integration.test_agent_local import alive, config, rank_proc, start, state, wait

TOKEN = "ab" * 16


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def head(tmp: Path, hosts: int = 1):
    cfg = config(tmp, [rank_proc(0, ["sleep", "300"])], [0])
    cfg["hosts"] = [f"h{i}" for i in range(1, hosts + 1)]
    cfg["all_ranks"] += [{"rank": i - 1, "host": f"h{i}", "device": 0, "pid": None, "state": "pending",
                          "exit_code": None, "signal": None, "start": None, "end": None, "attempt": 0}
                         for i in range(2, hosts + 1)]
    cfg["lost_after"] = 600
    cfg["join_timeout"] = 600
    p = start(tmp, cfg)
    line = p.stdout.readline().decode().split()
    return p, cfg, int(line[2])


def flood(port: int, n: int, payload: bytes) -> list[socket.socket]:
    """n connections to the head, each sending `payload`, after a second (the caller reads the
    head's RSS and CPU, then closes them)."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        try:
            if payload:
                s.sendall(payload)
        except OSError:
            pass
        socks.append(s)
    time.sleep(1.0)
    return socks


def hostile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    with tempfile.TemporaryDirectory() as d:
        p, cfg, port = head(Path(d))
        try:
            time.sleep(0.5)
            base, c0 = rss_mib(p.pid), cpu_s(p.pid)
            held = flood(port, 1000, b"")
            idle, c1 = rss_mib(p.pid), cpu_s(p.pid)
            held += flood(port, 150, b"y" * (1 << 20))
            lines, c2 = rss_mib(p.pid), cpu_s(p.pid)
            for s in held:
                s.close()
            rejects = []
            for _ in range(50):
                t0 = time.perf_counter()
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"[]\n")
                while s.recv(4096):
                    pass
                rejects.append(time.perf_counter() - t0)
                s.close()
            assert state(cfg).get("state") == "running"   # the run goes on, unharmed
            print(f"head at rest: RSS {base:.1f} MiB")
            print(f"1,000 idle unauthenticated connections: RSS {idle:.1f} MiB, head CPU {c1 - c0:.2f} s "
                  f"(at most {S.PER_SOURCE} kept from one address: a newcomer evicts the oldest)")
            print(f"150 connections x 1 MB without a newline: RSS {lines:.1f} MiB, head CPU {c2 - c1:.2f} s "
                  f"(each closed at {proto.PREAUTH_LINE} bytes)")
            print(f"rejecting one bad connection (connect, `[]`, closed): median "
                  f"{statistics.median(rejects) * 1000:.2f} ms of 50")
        finally:
            p.kill()
            p.wait()


def joins(n_hosts: int = 128) -> None:
    with tempfile.TemporaryDirectory() as d:
        p, cfg, port = head(Path(d), n_hosts)
        try:
            time.sleep(0.5)
            c0, t0 = cpu_s(p.pid), time.perf_counter()
            conns, errors = [], []

            def member(i):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:   # as a member does: retry what was turned away
                    try:
                        c, _ = S.open_client(["127.0.0.1"], port, TOKEN, "R1", "member", f"h{i}", proto.LINE,
                                             timeout=30)
                        conns.append(c)
                        return
                    except (OSError, proto.ProtocolError) as exc:
                        errors.append(exc)
                        time.sleep(0.5)

            threads = [threading.Thread(target=member, args=(i,)) for i in range(2, n_hosts + 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wait(lambda: state(cfg).get("state") == "running", 30)
            wall, cpu = time.perf_counter() - t0, cpu_s(p.pid) - c0
            print(f"{n_hosts - 1} members joining at once ({n_hosts} hosts): all joined and attempt 1 started in "
                  f"{wall:.2f} s; the head's CPU {cpu / (n_hosts - 1) * 1000:.2f} ms per join (handshake, HMACs, "
                  f"the start); {len(errors)} attempts turned away and retried")
            for c in conns:
                c.close()
        finally:
            p.kill()
            p.wait()


def crash_local() -> None:
    times = []
    for _ in range(5):
        with tempfile.TemporaryDirectory() as d:
            cfg = config(Path(d), [rank_proc(0, ["sleep", "300"]), rank_proc(1, ["sleep", "300"])], [0, 1])
            p = start(Path(d), cfg)
            wait(lambda cfg=cfg: state(cfg).get("state") == "running" and all(r.get("pid") for r in state(cfg)["ranks"]))
            pids = [r["pid"] for r in state(cfg)["ranks"]]
            t0 = time.perf_counter()
            p.send_signal(signal.SIGKILL)
            p.wait()
            wait(lambda pids=pids: not any(alive(x) for x in pids), 10)
            times.append(time.perf_counter() - t0)
    print(f"head crash (kill -9) to its own ranks gone: median {statistics.median(times) * 1000:.0f} ms of 5")


def crash_lab() -> None:
    from tests.benchmarks.benchlib import lab_up
    from tests.support import leftovers, wait_until

    lab = lab_up("pbhd", 4)
    try:
        inv = lab.inventory_path
        times = []
        with tempfile.TemporaryDirectory() as d:
            import yaml

            inventory = yaml.safe_load(Path(inv).read_text())
            inventory["defaults"]["slots"] = 1
            Path(d, "cluster.yaml").write_text(json.dumps({
                "inventory": inventory, "ssh": {"connect_timeout": 5},
                "job": {"workdir": "/data/bench-crash", "launcher": "ranktable", "command": "sleep 300"}}))
            for _ in range(3):
                run_id = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", "-q", "--detach",
                                         "--skip-checks"], cwd=d, capture_output=True, text=True,
                                        check=True).stdout.strip()
                assert wait_until(lambda run_id=run_id: len(leftovers(run_id, "sleep")) == 4, 60), leftovers(run_id)
                doc = json.loads(lab.exec(1, ["cat", f"/data/bench-crash/.orch/{run_id}/state.json"]).stdout)
                t0 = time.perf_counter()
                lab.exec(1, ["kill", "-9", str(doc["agent_pid"])])
                assert wait_until(lambda run_id=run_id: leftovers(run_id) == [], 60, interval=0.01)
                times.append(time.perf_counter() - t0)
        print(f"head crash (kill -9) to the last process of the run gone on every host (4 hosts): median "
              f"{statistics.median(times) * 1000:.0f} ms of 3 ({', '.join(f'{t * 1000:.0f}' for t in times)} ms)")
    finally:
        lab.down()


def decide(n_hosts: int = 128, slots: int = 8, rounds: int = 8, idle: int = 200) -> None:
    """head.decide in this process (it is pure): what each turn of the head's loop costs in its
    decisions as the run grows (every duty reads the run's ranks: Head's indexes keep it short)."""
    from orchestrator.agent import head as H

    hosts = [f"h{i}" for i in range(1, n_hosts + 1)]
    ranks = [{"rank": h * slots + d, "host": hosts[h], "device": d, "pid": None, "state": "pending",
              "exit_code": None, "signal": None, "start": None, "end": None, "attempt": 0}
             for h in range(n_hosts) for d in range(slots)]
    t = 1000.0
    head = H.Head({"run_id": "r", "host": hosts[0], "hosts": hosts, "all_ranks": ranks, "launcher": "ranktable"}, t)
    H.decide(head, [H.joined(h, "10.0.0.1") for h in hosts[1:]], t)

    def report(i, state, end=None, code=None):
        rs = [{"rank": i * slots + d, "host": hosts[i], "device": d, "pid": 100 + d, "state": state,
               "exit_code": code, "signal": None, "start": 1001.0, "end": end, "attempt": 1} for d in range(slots)]
        return H.reported(hosts[i], {"host": hosts[i], "attempt": 1, "out": t, "live": True, "stopping": None,
                                     "ranks": rs, "procs": [dict(r, key=f"rank.{r['rank']}") for r in rs]})

    turns = []
    for k in range(rounds + 1):
        for i in range(n_hosts):
            t += 0.001
            ev = report(i, "running") if k < rounds else report(i, "exited", t, 0)
            c0 = time.process_time()
            H.decide(head, [ev], t)
            turns.append(time.process_time() - c0)
    c0 = time.process_time()
    for _ in range(idle):
        t += 0.0005
        H.decide(head, [], t)
    idle_ms = (time.process_time() - c0) / idle * 1000
    print(f"head.decide at {n_hosts} hosts x {slots} ranks: {len(turns)} reports, "
          f"{sum(turns) / len(turns) * 1000:.3f} ms of CPU a turn with a report (median "
          f"{statistics.median(turns) * 1000:.3f}), {idle_ms:.3f} ms an idle turn; the run {head.doc['state']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lab", action="store_true", help="also the crash on a 4-host lab (root)")
    ap.add_argument("--hosts", type=int, default=128)
    args = ap.parse_args()
    hostile()
    joins(args.hosts)
    decide(args.hosts)
    crash_local()
    if args.lab:
        crash_lab()


if __name__ == "__main__":
    main()
