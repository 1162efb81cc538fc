"""Log gathering: orch's incremental gather against `ssh host tar c | tar x` from every host at once.

    python tests/benchmarks/bench_gather.py [--mb 50] [--repeat 3] [--keep]

4 lab hosts x 4 ranks (lab `pbgat`): `orch up --detach` starts a job whose ranks sleep, and each
rank's log (workdir/log_output/1/rank.N/stdout, where mpirun puts it) is then filled with MB
megabytes of random bytes (incompressible) on its host. Measured, alternating:

- orch:   `orch logs --run ID --rank 0 --tail 1`: a running run is gathered first, every rank
          from every host (the local copies are removed before each repetition: a full gather);
- tar:    `ssh HOST "cd WORKDIR && tar c log_output" | tar x` for the 4 hosts in parallel.

Then every rank's log grows by 1 MB and orch gathers again: the bytes that crossed the lab
links (host -> controller, from the veth counters) per rank show that only the new bytes move.
Peak RSS of the orch process shows whether gathering streams (flat) or buffers (grows with MB).
Targets: orch throughput >= 0.8 x tar's; <= 2 MB per rank for the 1 MB increment.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    ORCH, SshdCounter, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, ssh_base, table,
    write_cluster,
)

N_HOSTS, SLOTS = 4, 4
WORKDIR = "/data/benchgather"
LOGS = f"{WORKDIR}/log_output/1"


def rx_bytes(hosts) -> int:
    """Bytes this machine received from the hosts (the root-side veth's rx counters)."""
    total = 0
    for h in hosts:
        veth = h.lab.veth_name(h.index)
        total += int(Path(f"/sys/class/net/{veth}/statistics/rx_bytes").read_text())
    return total


def ssh(h, command: str, timeout: float = 300) -> str:
    m = measure(ssh_base(h) + [h.address, command], timeout=timeout).check(f"ssh {h.name}: {command[:60]}")
    return m.stdout.decode()


def on_all(hosts, command_for) -> None:
    """Run a command on every host at once (setup steps, not measured)."""
    script = "\n".join(f"{shlex.join(ssh_base(h))} {h.address} {shlex.quote(command_for(i, h))} & p{i}=$!"
                       for i, h in enumerate(hosts))
    script += "\n" + "\n".join(f"wait $p{i} || exit 1" for i in range(len(hosts)))
    measure(["sh", "-c", script], timeout=600).check("setup on every host")


def bench(mb: int, repeat: int, keep: bool, lab_name: str = "pbgat"):
    lab = lab_up(lab_name, N_HOSTS)
    hosts = lab_hosts([lab], N_HOSTS)
    size = mb << 20
    total = size * N_HOSTS * SLOTS
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-gather-"))
    run_id = None
    samples: dict[str, list] = {"orch": [], "tar": []}
    try:
        cluster = write_cluster(tmp / "gather.yaml", hosts, slots=SLOTS,
                                job={"workdir": WORKDIR, "command": ["sleep", "900"], "launcher": "mpirun",
                                     "platform": "cpu", "log_dir": "log_output", "timeout": 1200})
        m = measure(ORCH + ["up", str(cluster), "--detach", "-q"], env=base_env(), cwd=tmp, timeout=300)
        m.check("orch up --detach")
        run_id = m.stdout.decode().split()[0]
        deadline = time.monotonic() + 60
        while True:  # mpirun creates every rank's log when the ranks start
            n = sum(int(ssh(h, f"ls {LOGS}/rank.*/stdout 2>/dev/null | wc -l").strip() or 0) for h in hosts)
            if n == N_HOSTS * SLOTS:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {n} rank logs appeared")
            time.sleep(0.5)
        on_all(hosts, lambda i, h: f"for d in {LOGS}/rank.*; do head -c {size} /dev/urandom > $d/stdout || exit 1; "
                                   "done")
        local_logs = tmp / ".orch" / "runs" / run_id / "logs"
        orch_logs = ORCH + ["logs", "--run", run_id, "--rank", "0", "--tail", "1"]
        for rep in range(repeat):
            for tool in (["orch", "tar"] if rep % 2 == 0 else ["tar", "orch"]):
                counter = SshdCounter(hosts).start()
                rx0 = rx_bytes(hosts)
                if tool == "orch":
                    shutil.rmtree(local_logs, ignore_errors=True)
                    m = measure(orch_logs, env=base_env(), cwd=tmp, timeout=900)
                    got = sum((local_logs / f"rank.{r}" / "stdout").stat().st_size
                              for r in range(N_HOSTS * SLOTS) if (local_logs / f"rank.{r}" / "stdout").exists())
                else:
                    dest = tmp / "tar"
                    shutil.rmtree(dest, ignore_errors=True)
                    script = []
                    for h in hosts:
                        (dest / h.name).mkdir(parents=True)
                        script.append(f"{shlex.join(ssh_base(h))} {h.address} "
                                      f"{shlex.quote(f'cd {WORKDIR} && tar c log_output')} | "
                                      f"tar x -C {shlex.quote(str(dest / h.name))} &")
                    m = measure(["sh", "-c", "\n".join(script) + "\nwait"], timeout=900)
                    got = sum(p.stat().st_size for p in dest.glob("*/log_output/1/rank.*/stdout"))
                moved = rx_bytes(hosts) - rx0
                conns = counter.from_controller()
                ok = m.rc == 0 and got == total
                samples[tool].append((m, ok, moved, conns))
                print(f"  gather {tool:4s} rep {rep + 1}: wall {m.wall:6.2f}s {total / m.wall / 1e6:7.1f} MB/s "
                      f"cpu {m.cpu:5.2f}s rss {m.maxrss_kb // 1024} MiB moved {moved / 1e6:.1f} MB "
                      f"conns/host {conn_summary(conns)} complete={ok}", file=sys.stderr, flush=True)
        # exactness: every gathered copy is the remote file
        remote = {}
        for h in hosts:
            for line in ssh(h, f"cd {LOGS} && sha256sum rank.*/stdout").splitlines():
                digest, name = line.split()
                remote[int(name.split("/")[0].split(".")[1])] = digest
        exact = all(hashlib.sha256((local_logs / f"rank.{r}" / "stdout").read_bytes()).hexdigest() == remote[r]
                    for r in remote)
        # incremental: 1 MB more per rank, then the next gather
        incr = []
        for rep in range(repeat):
            on_all(hosts, lambda i, h: f"for d in {LOGS}/rank.*; do head -c 1048576 /dev/urandom >> $d/stdout "
                                       "|| exit 1; done")
            rx0 = rx_bytes(hosts)
            before = sum((local_logs / f"rank.{r}" / "stdout").stat().st_size for r in range(N_HOSTS * SLOTS))
            m = measure(orch_logs, env=base_env(), cwd=tmp, timeout=300)
            after = sum((local_logs / f"rank.{r}" / "stdout").stat().st_size for r in range(N_HOSTS * SLOTS))
            moved = rx_bytes(hosts) - rx0
            incr.append((m, moved, after - before))
            print(f"  gather +1MB/rank rep {rep + 1}: wall {m.wall:5.2f}s moved {moved / 1e6:.2f} MB "
                  f"({moved / (N_HOSTS * SLOTS) / 1e6:.2f} MB/rank) appended {(after - before) / 1e6:.1f} MB "
                  f"rss {m.maxrss_kb // 1024} MiB", file=sys.stderr, flush=True)
    finally:
        if run_id:
            measure(ORCH + ["down", "--run", run_id], env=base_env(), cwd=tmp, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
        if not keep:
            lab.down()
    rows, records = [], []
    for tool, s in samples.items():
        wall = median([m.wall for m, *_ in s])
        rec = {"bench": "gather", "tool": tool, "wall_s": wall, "mb_s": total / wall / 1e6, "mb": mb,
               "cpu_s": median([m.cpu for m, *_ in s]), "maxrss_mib": max(m.maxrss_kb for m, *_ in s) / 1024,
               "conns_per_host": conn_summary([c for *_, cs in s for c in cs]),
               "complete": all(ok for _, ok, _, _ in s), "walls": [round(m.wall, 2) for m, *_ in s]}
        records.append(rec)
        rows.append([f"{N_HOSTS}x{SLOTS}x{mb} MB", tool, fmt(wall, " s"), fmt(rec["mb_s"], " MB/s", 0),
                     fmt(rec["cpu_s"], " s"), fmt(rec["maxrss_mib"], " MiB", 0) if tool == "orch" else "-",
                     rec["conns_per_host"],
                     "yes" if rec["complete"] else "NO", " ".join(f"{w:.2f}" for w in rec["walls"])])
    per_rank = median([moved / (N_HOSTS * SLOTS) for _, moved, _ in incr])
    rec = {"bench": "gather-incr", "moved_mb_per_rank": per_rank / 1e6,
           "wall_s": median([m.wall for m, _, _ in incr]), "maxrss_mib": max(m.maxrss_kb for m, _, _ in incr) / 1024,
           "appended_ok": all(a == (1 << 20) * N_HOSTS * SLOTS for _, _, a in incr), "exact": exact}
    records.append(rec)
    rows.append(["+1 MB per rank", "orch", fmt(rec["wall_s"], " s"), f"{per_rank / 1e6:.2f} MB/rank moved", "",
                 fmt(rec["maxrss_mib"], " MiB", 0), "", "yes" if rec["appended_ok"] and exact else "NO", ""])
    ratio = records[0]["mb_s"] / records[1]["mb_s"]
    text = table(["logs", "how", "wall (median)", "throughput", "CPU", "peak RSS", "conns/host", "exact", "walls"],
                 rows)
    text += f"\norch / tar throughput = {ratio:.2f} (target >= 0.8)"
    records.append({"bench": "gather", "ratio": ratio})
    return text, records


def verdicts(records) -> list[str]:
    ratio = next(r["ratio"] for r in records if "ratio" in r)
    inc = next(r for r in records if r.get("bench") == "gather-incr")
    o = next(r for r in records if r.get("tool") == "orch")
    return [f"{'MET ' if ratio >= 0.8 else 'MISS'} gather throughput >= 0.8 x tar: {ratio:.2f}",
            f"{'MET ' if inc['moved_mb_per_rank'] <= 2 else 'MISS'} +1 MB per rank moves <= 2 MB per rank: "
            f"{inc['moved_mb_per_rank']:.2f} MB",
            f"INFO orch's peak RSS: {o['maxrss_mib']:.0f} MiB gathering {N_HOSTS * SLOTS} x {o['mb']} MB, "
            f"{inc['maxrss_mib']:.0f} MiB gathering {N_HOSTS * SLOTS} x 1 MB (streamed: it does not grow with "
            "the logs)"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    text, records = bench(a.mb, a.repeat, a.keep)
    print(text)
    print("\n".join(verdicts(records)))


if __name__ == "__main__":
    main()
