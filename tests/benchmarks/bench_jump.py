"""`orch check` on hosts reached directly vs through one bastion (jump host).

    python tests/benchmarks/bench_jump.py [--hosts 32] [--repeat 5] [--jump-fanout 10] [--keep]

Two labs of N hosts each: `pbjd` (reachable from here) and `pbjb` (made with --bastion: the
hosts sit on a network this machine has no address on; only the bastion reaches them). The
same cluster file (the lab's inventory; the bastion lab's says `jump:` in its defaults), run
alternately, `--repeat` times each:

- wall time and controller CPU (user+sys) of `orch check FILE --json`, and per host;
- SSH logins the bastion's sshd accepted per invocation (orch opens ONE connection to a jump
  host and tunnels every host behind it through it), and logins each host accepted from the
  controller's side (one per host; through the bastion they come from the bastion's address).

Targets: through the bastion, exactly 1 bastion login per invocation, and per host the same
logins as direct (1 from the controller; the other hosts 1 more each from the launch host, the
mesh test). A tunnel costs the controller a channel and a second layer of encryption of the
same bytes, not a handshake more: a few ms of CPU per host.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import ORCH, base_env, fmt, measure, median, table

from orchestrator.lab import Lab


def lab(name: str, n: int, bastion: bool) -> Lab:
    got = Lab(name)
    if got.exists():
        try:
            if len(got.hosts) == n and bool(got.bastion) == bastion and all(s.ok for s in got.status()):
                return got
        except Exception:  # noqa: BLE001 - a broken lab of ours is remade
            pass
    return got.up(n, bastion=bastion)


def logins(path: Path) -> int:
    try:
        return path.read_text(errors="replace").count("Accepted publickey")
    except FileNotFoundError:
        return 0


def write(work: Path, name: str, lb: Lab, fanout: int) -> Path:
    p = work / f"{name}.yaml"
    p.write_text(json.dumps({"inventory": str(lb.inventory_path),
                             "ssh": {"config_file": "none", "fanout": 64, "jump_fanout": fanout},
                             "job": {"workdir": "/data/bench-jump", "command": "hostname"}}))
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--jump-fanout", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="leave the labs up")
    args = ap.parse_args()
    n = args.hosts
    direct, behind = lab("pbjd", n, False), lab("pbjb", n, True)
    work = Path(tempfile.mkdtemp(prefix="bench-jump-"))
    files = {"direct": write(work, "direct", direct, args.jump_fanout),
             "bastion": write(work, "bastion", behind, args.jump_fanout)}
    labs = {"direct": direct, "bastion": behind}
    got: dict[str, dict[str, list]] = {k: {"wall": [], "cpu": [], "bastion": [], "per_host": []} for k in files}
    try:
        for _ in range(args.repeat):
            for kind, path in files.items():
                lb = labs[kind]
                before_b = logins(lb.bastion_sshd_log) if lb.bastion else 0
                before_h = [logins(lb.sshd_log(h.index)) for h in lb.hosts]
                m = measure(ORCH + ["check", str(path), "--json"], env=base_env(), timeout=300)
                report = json.loads(m.stdout or b"{}")
                bad = [r for r in report.get("results", []) if r["status"] in ("fail", "error")]
                if m.rc != 0 or bad:
                    raise SystemExit(f"{kind}: orch check failed (exit {m.rc}): {bad[:3]} "
                                     f"{m.stderr.decode(errors='replace')[-500:]}")
                got[kind]["wall"].append(m.wall)
                got[kind]["cpu"].append(m.cpu)
                got[kind]["bastion"].append((logins(lb.bastion_sshd_log) - before_b) if lb.bastion else None)
                got[kind]["per_host"].append(sorted({logins(lb.sshd_log(h.index)) - b
                                                     for h, b in zip(lb.hosts, before_h)}))
    finally:
        if not args.keep:
            direct.down()
            behind.down()
    rows = []
    for kind, g in got.items():
        rows.append([kind, str(n), fmt(median(g["wall"]), "s"), fmt(median(g["cpu"]), "s"),
                     fmt(median(g["cpu"]) / n * 1000, "ms", 1),
                     "-" if g["bastion"][0] is None else ",".join(map(str, sorted(set(g["bastion"])))),
                     ",".join("-".join(map(str, p)) for p in {tuple(p) for p in g["per_host"]})])
    print(f"orch check, {n} hosts, median of {args.repeat} (ssh.jump_fanout {args.jump_fanout}):")
    print(table(["route", "hosts", "wall", "controller CPU", "CPU/host", "bastion logins/run",
                 "logins per host/run (mesh: +1)"], rows))
    d, b = median(got["direct"]["cpu"]), median(got["bastion"]["cpu"])
    print(f"through the bastion: controller CPU {100 * (b / d - 1):+.0f}% vs direct")


if __name__ == "__main__":
    main()
