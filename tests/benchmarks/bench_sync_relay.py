"""Code sync over a slow controller link: through the launch host vs from the controller vs
parallel rsync.

    python tests/benchmarks/bench_sync_relay.py [--hosts 8] [--mbit 50] [--repeat 1] [--keep]

Needs root (the lab, a network namespace, `tc`) and rsync. The controller runs in its own
network namespace whose only link (a veth on the lab's bridge, 198.18.K.200) is shaped to
--mbit in both directions with `tc tbf`: the laptop-on-a-VPN case. A project of 200 small files
(10 KB each) and a 20 MB binary goes to --hosts lab hosts, each run from empty workdirs:

- orch relay:    the sync step alone (sync.sync_hosts, job.sync_via: launch-host);
- orch direct:   the same, job.sync_via: controller (every host its own copy);
- orch up relay: `orch up -q --skip-checks` (sync, supervisors, a `true` job, gather);
- rsync:         `rsync -a` to every host at once (what orch replaces);
- rsync relay:   `rsync -a` to the launch host, then from it to the others at once (by hand).

Bytes over the controller's link are its interface counters (rx + tx) around each run, shown
as copies of the tree. Targets: orch relay <= 0.35x parallel rsync, <= 1.2 copies.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ORCH, base_env, fmt, lab_hosts, lab_up, measure, median, ssh_base, table, write_cluster

WORKDIR = "/data/benchrelay"
WAIT_ALL = '\nfor p in $P; do wait "$p" || exit 1; done'  # every background job, failing if one did
SYNC_ONLY = r"""
import sys
from orchestrator import sync
from orchestrator.errors import OrchError
from orchestrator.fanout import fan_out
from orchestrator.rankplan import make_plan
from orchestrator.spec import load_cluster
from orchestrator.transport import Pool
c = load_cluster(sys.argv[1])
plan = make_plan(c)
entries = sync.job_manifest(c)
with Pool(c) as pool:
    res = sync.sync_hosts(pool, plan.all_hosts, plan.launch_host, c.job.workdir, entries, {}, via=sys.argv[2],
                          ssh=c.ssh, fan=lambda hosts, fn: fan_out(hosts, fn, limit=c.ssh.fanout))
    res.raise_if_failed(OrchError, "sync failed")
"""


def project(root: Path) -> tuple[Path, int]:
    proj = root / "proj"
    for i in range(200):
        d = proj / f"pkg{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_bytes(os.urandom(5 << 10).hex().encode())  # 10 KB, incompressible-ish
    (proj / "weights.bin").write_bytes(os.urandom(20 << 20))
    return proj, sum(p.stat().st_size for p in proj.rglob("*") if p.is_file())


def sh(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60, **kw)


class Controller:
    """A network namespace with one veth on the lab's bridge, shaped to `mbit` both ways."""

    def __init__(self, lab, mbit: int):
        self.ns = f"pbrelayc-{os.getpid()}"
        self.veth = f"pbrc{os.getpid() % 100000}"
        subnet = lab.subnet.split("/")[0].rsplit(".", 1)[0]  # 198.18.K
        assert subnet.startswith("198.18."), subnet
        self.address = f"{subnet}.200"
        sh(["ip", "netns", "add", self.ns])
        sh(["ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.ns])
        sh(["ip", "link", "set", self.veth, "master", lab.bridge, "up"])
        self.exec_(["ip", "addr", "add", f"{self.address}/24", "dev", "eth0"])
        self.exec_(["ip", "link", "set", "eth0", "up"])
        self.exec_(["ip", "link", "set", "lo", "up"])
        shape = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "200ms"]
        sh(["tc", "qdisc", "add", "dev", self.veth, *shape])        # towards the controller
        self.exec_(["tc", "qdisc", "add", "dev", "eth0", *shape])   # from the controller

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def exec_(self, argv: list[str]) -> subprocess.CompletedProcess:
        return sh(self.prefix() + argv)

    def link_bytes(self) -> int:
        out = self.exec_(["cat", "/sys/class/net/eth0/statistics/rx_bytes", "/sys/class/net/eth0/statistics/tx_bytes"])
        return sum(int(x) for x in out.stdout.split())

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


def clean(hosts) -> None:
    for h in hosts:
        h.lab.exec(h.index, ["rm", "-rf", WORKDIR])
        h.lab.exec(h.index, ["mkdir", "-p", WORKDIR])


def rsync_all(hosts, proj: Path) -> list[str]:
    ssh = shlex.join(ssh_base(hosts[0]))
    lines = [f"rsync -a -e {shlex.quote(ssh)} {shlex.quote(str(proj))} root@{h.address}:{WORKDIR}/ & P=\"$P $!\""
             for h in hosts]
    return ["sh", "-c", "\n".join(lines) + WAIT_ALL]


def rsync_relay(hosts, proj: Path) -> list[str]:
    ssh = shlex.join(ssh_base(hosts[0]))
    inner = "\n".join(f"rsync -a -e 'ssh -o BatchMode=yes' {WORKDIR}/proj root@{h.address}:{WORKDIR}/ & P=\"$P $!\""
                      for h in hosts[1:]) + WAIT_ALL
    return ["sh", "-c", f"rsync -a -e {shlex.quote(ssh)} {shlex.quote(str(proj))} root@{hosts[0].address}:{WORKDIR}/ "
                        f"&& {ssh} {hosts[0].address} {shlex.quote(inner)}"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--mbit", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    lab = lab_up("pbrelay", a.hosts)
    hosts = lab_hosts([lab], a.hosts)
    ctl = None
    samples: dict[str, list[tuple[float, float]]] = {}
    try:
        ctl = Controller(lab, a.mbit)
        with tempfile.TemporaryDirectory(prefix="orch-bench-relay-") as tmp:
            work = Path(tmp)
            proj, tree = project(work)
            cluster = write_cluster(work / "relay.yaml", hosts, slots=1, job={
                "workdir": WORKDIR, "command": ["true"], "launcher": "ranktable", "sync": [str(proj)],
                "sync_via": "launch-host"})
            how = {
                "orch relay (sync step)": [sys.executable, "-c", SYNC_ONLY, str(cluster), "launch-host"],
                "orch direct (sync step)": [sys.executable, "-c", SYNC_ONLY, str(cluster), "controller"],
                "orch up -q, relay": ORCH + ["up", str(cluster), "-q", "--skip-checks"],
                "parallel rsync": rsync_all(hosts, proj),
                "rsync relay (by hand)": rsync_relay(hosts, proj),
            }
            for rep in range(a.repeat):
                for name, cmd in (how.items() if rep % 2 == 0 else reversed(how.items())):
                    clean(hosts)
                    before = ctl.link_bytes()
                    m = measure(ctl.prefix() + cmd, env=base_env(), cwd=work, timeout=900)
                    crossed = ctl.link_bytes() - before
                    assert m.rc == 0, (name, m.stderr[-2000:])
                    for h in hosts:  # every host got the whole tree
                        got = h.lab.exec(h.index, ["sh", "-c", f"cat {WORKDIR}/proj/weights.bin | wc -c"]).stdout
                        assert int(got) == 20 << 20, (name, h.name, got)
                    samples.setdefault(name, []).append((m.wall, crossed))
                    print(f"  {name:26s} rep {rep + 1}: {m.wall:6.2f} s, {crossed / tree:5.2f} copies over the link",
                          file=sys.stderr, flush=True)
    finally:
        if ctl is not None:
            ctl.close()
        if not a.keep:
            lab.down()
    walls = {n: median([w for w, _ in s]) for n, s in samples.items()}
    copies = {n: median([c for _, c in s]) / tree for n, s in samples.items()}
    rows = [[n, fmt(walls[n], " s"), f"{copies[n]:.2f}", f"{walls[n] / walls['parallel rsync']:.2f}"] for n in samples]
    print(f"{tree / 1e6:.1f} MB in 201 files to {a.hosts} lab hosts, first sync, the controller's link shaped to "
          f"{a.mbit} Mbit/s ({os.cpu_count()} cores, median of {a.repeat}):")
    print(table(["how", "wall", "copies over the controller's link", "/ parallel rsync"], rows))
    r = walls["orch relay (sync step)"] / walls["parallel rsync"]
    c = copies["orch relay (sync step)"]
    print(f"{'MET ' if r <= 0.35 else 'MISS'} orch relay / parallel rsync = {r:.2f} (target <= 0.35)")
    print(f"{'MET ' if c <= 1.2 else 'MISS'} copies of the tree over the controller's link = {c:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()
