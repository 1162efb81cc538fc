"""Preflight at scale: `orch check` against pdsh and Ansible running the SAME probe script.

    python tests/benchmarks/bench_check.py [--sizes 8,32,64] [--repeat 3] [--keep] [--tools orch,pdsh-c25519]
        [--before SRC] [--lab NAME]

On 8, 32 and 64 lab hosts (one lab, `pbchk`), each repetition runs, in rotating order:

- orch:    `orch check FILE --json` (fan-out 64, one SSH connection per host);
- pdsh:    `pdsh -R ssh -f 64` with the lab key (PDSH_SSH_ARGS_APPEND, BatchMode), sending
           `exec sh -c <probe>`, the very command orch sends; the launch host gets its own
           probe (it also tests ssh to every other host, as mpirun will) from a second pdsh
           started at the same moment, as orch's probes differ only there;
- pdsh-c25519: the same with `-o KexAlgorithms=curve25519-sha256`, the key exchange paramiko
           (so orch) uses: OpenSSH >= 9.0 defaults to sntrup761x25519, which costs the
           client ~0.15 s of CPU per connection;
- ansible: `ansible all -m raw -f 64` (ansible-core in a separate venv), same commands
           (the per-host choice made in the ad-hoc argument's template); Ansible's default
           ssh arguments, except ControlPersist off so that every run starts cold like the
           others.

A size above one lab's 240 hosts (`--sizes 64,128,256`) takes two labs, `pbchk` and `pbchk2`,
half the hosts each, interleaved; the lab bridges are not routed to each other, so the launch
host's ssh test to every other host (check `mesh`) is skipped at EVERY size of such a run, for
every tool (the table says so), and pdsh runs once per lab (each lab has its own key).

- orch-1proc (only with --tools): orch with ORCH_FANOUT_PROCS=1, the fan-out in one process
           whatever the host count (orch itself uses one process per 128 hosts, up to one per core).
- before (with --before SRC): `orch check` from another copy of the package (SRC: the directory
           holding its `orchestrator/`), in the same rotation: a before/after comparison in one
           lab, alternating. Its probes are its own (its --print-probe is not asked).

Probes come from `orch check FILE --print-probe HOST`. Reported: median wall time,
controller CPU (user+sys of the command and its children) per host, for orch also its main
process's own CPU per host (the busiest core's share when it fans out from several), SSH connections
each host accepted from the controller (sshd logs) and whether every host's probe
output came back complete.
Targets: orch wall <= pdsh wall at 32 and 64 hosts; controller CPU <= 30 ms per host;
exactly 1 controller connection per host; from 64 hosts: orch wall <= 0.8x pdsh-c25519's,
and at 256 hosts controller CPU <= 8 ms per host. Last, a 1,000-host projection from the
per-host figures of the largest two sizes (its assumption printed with it).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    ORCH, SshdCounter, ansible_bin, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, pdsh_available,
    pdsh_env, remote_sh, table, write_cluster,
)
from orchestrator.lab.model import MAX_HOSTS
from orchestrator.shards import HOSTS_PER_PROC

END = b"@@orch:end clock1 "
TOOLS = ("orch", "pdsh", "pdsh-c25519", "ansible", "orch-1proc", "before")  # the last two: only when asked for
PROJECT_TO = 1000


def probes(cluster: Path, names: list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        m = measure(ORCH + ["check", str(cluster), "--print-probe", n], env=base_env()).check("--print-probe")
        out[n] = m.stdout.decode()
    return out


def run_orch(cluster: Path, n: int, procs: str | None = None, src: str | None = None):
    # src: another copy of the package (--before) in place of this tree's
    env = base_env(src, **({"ORCH_FANOUT_PROCS": procs} if procs else {}))
    m = measure(ORCH + ["check", str(cluster), "--json"], env=env, timeout=300)
    try:
        report = json.loads(m.stdout)
        ssh_ok = sum(1 for r in report["results"] if r["check"] == "ssh" and r["status"] == "pass")
        complete = ssh_ok == n and not any(r["status"] in ("fail", "error") for r in report["results"])
    except ValueError:
        complete = False
    return m, complete


def run_pdsh(hosts, launch_probe: str, other_probe: str, kex: str | None = None):
    def pdsh(group, fanout: int, probe: str) -> str:
        args = pdsh_env(group[0].lab)["PDSH_SSH_ARGS_APPEND"] + (f" -o KexAlgorithms={kex}" if kex else "")
        return (f"PDSH_SSH_ARGS_APPEND={shlex.quote(args)} pdsh -R ssh -f {fanout} "
                f"-w {','.join(h.address for h in group)} {shlex.quote(remote_sh(probe))}")

    first, rest = hosts[0], hosts[1:]
    cmds = [pdsh([first], 1, launch_probe)]
    for lab in dict.fromkeys(h.lab for h in rest):  # one pdsh per lab (each has its own key), 64 at once in all
        mine = [h for h in rest if h.lab is lab]
        cmds.append(pdsh(mine, max(1, 64 * len(mine) // len(rest)), other_probe))
    script = " & ".join(cmds) + "; wait"
    m = measure(["sh", "-c", script], env=pdsh_env(first.lab), timeout=600)
    return m, m.stdout.count(END) == len(hosts)


def run_ansible(hosts, launch_probe: str, other_probe: str, work: Path):
    lab = hosts[0].lab
    inv = {"all": {"hosts": {h.name: {"ansible_host": h.address} for h in hosts},
                   "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(lab.key_path)}}}
    inv_path = work / "ansible-inventory.json"
    inv_path.write_text(json.dumps(inv))
    arg = ("{% if inventory_hostname == '" + hosts[0].name + "' %}{% raw %}" + remote_sh(launch_probe)
           + "{% endraw %}{% else %}{% raw %}" + remote_sh(other_probe) + "{% endraw %}{% endif %}")
    home = work / "ansible-home"
    env = base_env(
        ANSIBLE_HOME=home, ANSIBLE_LOCAL_TEMP=home / "tmp", ANSIBLE_SSH_CONTROL_PATH_DIR=home / "cp",
        ANSIBLE_CONFIG=work / "no-ansible.cfg", ANSIBLE_NOCOLOR=1, ANSIBLE_HOST_KEY_CHECKING=True,
        ANSIBLE_TIMEOUT=10, ANSIBLE_DEPRECATION_WARNINGS=False, ANSIBLE_PYTHON_INTERPRETER="auto_silent",
        ANSIBLE_SSH_ARGS=f"-C -o ControlMaster=auto -o ControlPersist=no -F /dev/null "
                         f"-o UserKnownHostsFile={lab.known_hosts_path} -o BatchMode=yes",
    )
    # JSON module arguments: the probe is passed verbatim (no key=value splitting of a free-form string)
    m = measure([str(ansible_bin()), "all", "-i", str(inv_path), "-f", "64", "-m", "raw",
                 "-a", json.dumps({"_raw_params": arg})],
                env=env, timeout=600)
    return m, m.stdout.count(END) == len(hosts)


def bench_labs(need: int, lab_name: str = "pbchk") -> list:
    """One lab for up to MAX_HOSTS hosts, else two (`NAME`, `NAME2`) of half the hosts each."""
    if need <= MAX_HOSTS:
        return [lab_up(lab_name, need)]
    half = (need + 1) // 2
    return [lab_up(lab_name, half), lab_up(lab_name + "2", need - half)]


def bench_hosts(labs: list, n: int) -> list:
    """The first n hosts, taken from the labs in turn (the controller works every bridge)."""
    if len(labs) == 1:
        return lab_hosts(labs, n)
    each = [lab_hosts([lab], len(lab.hosts)) for lab in labs]
    return [h for group in zip(*each) for h in group][:n]


def bench(sizes: list[int], repeat: int, keep: bool, lab_name: str = "pbchk",
          only: list[str] | None = None, before: str | None = None) -> tuple[str, list[dict]]:
    labs = bench_labs(max(sizes), lab_name)
    mesh = len(labs) == 1  # the labs' bridges do not route to each other: no ssh from one lab's host to another's
    tools = ["orch"] + (["pdsh", "pdsh-c25519"] if pdsh_available() else []) + (["ansible"] if ansible_bin() else [])
    tools = [t for t in tools + ["orch-1proc"] if (only is None and t != "orch-1proc") or (only and t in only)]
    if before:
        tools.insert(1, "before")
    rows, records = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-check-") as tmp:
            work = Path(tmp)
            for n in sizes:
                hosts = bench_hosts(labs, n)
                cluster = write_cluster(work / f"check{n}.yaml", hosts, checks=None if mesh else {"skip": ["mesh"]})
                pr = probes(cluster, [hosts[0].name, hosts[-1].name])
                launch_probe, other_probe = pr[hosts[0].name], pr[hosts[-1].name]
                samples: dict[str, list] = {t: [] for t in tools}
                for rep in range(repeat):
                    order = tools[rep % len(tools):] + tools[:rep % len(tools)]
                    for tool in order:
                        counter = SshdCounter(hosts).start()
                        if tool in ("orch", "orch-1proc", "before"):
                            m, complete = run_orch(cluster, n, "1" if tool == "orch-1proc" else None,
                                                   before if tool == "before" else None)
                        elif tool == "pdsh":
                            m, complete = run_pdsh(hosts, launch_probe, other_probe)
                        elif tool == "pdsh-c25519":
                            m, complete = run_pdsh(hosts, launch_probe, other_probe, kex="curve25519-sha256")
                        else:
                            m, complete = run_ansible(hosts, launch_probe, other_probe, work)
                        conns = counter.from_controller()
                        samples[tool].append((m, complete, conns))
                        print(f"  check n={n} {tool:8s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:6.2f}s "
                              f"(main process {m.own_cpu:5.2f}s) "
                              f"rss {m.maxrss_kb // 1024} MiB conns/host {conn_summary(conns)} "
                              f"complete={complete}", file=sys.stderr, flush=True)
                for tool in tools:
                    s = samples[tool]
                    wall = median([m.wall for m, _, _ in s])
                    cpu = median([m.cpu for m, _, _ in s])
                    rec = {"bench": "check", "hosts": n, "tool": tool, "wall_s": wall, "cpu_s": cpu, "mesh": mesh,
                           "cpu_ms_per_host": 1000 * cpu / n,
                           "main_cpu_ms_per_host": 1000 * median([m.own_cpu for m, _, _ in s]) / n,
                           "maxrss_mib": median([m.maxrss_kb for m, _, _ in s]) / 1024,
                           "conns_per_host": conn_summary([c for _, _, cs in s for c in cs]),
                           "complete": all(c for _, c, _ in s), "walls": [round(m.wall, 2) for m, _, _ in s]}
                    records.append(rec)
                for rec in records[-len(tools):]:
                    ref = next((r for r in records[-len(tools):] if r["tool"] == "pdsh-c25519"), None)
                    ratio = rec["wall_s"] / ref["wall_s"] if ref and ref["wall_s"] else None
                    rows.append([str(n), rec["tool"], fmt(rec["wall_s"], " s"), fmt(ratio, "x"),
                                 fmt(rec["cpu_ms_per_host"], " ms", 1),
                                 fmt(rec["main_cpu_ms_per_host"], " ms", 1)
                                 if rec["tool"].startswith(("orch", "before")) else "-",
                                 fmt(rec["cpu_s"], " s"),
                                 rec["conns_per_host"], "yes" if rec["complete"] else "NO",
                                 " ".join(f"{w:.2f}" for w in rec["walls"])])
    finally:
        if not keep:
            for lab in labs:
                lab.down()
    text = table(["hosts", "tool", "wall (median)", "vs pdsh-c25519", "CPU/host", "main process CPU/host",
                  "CPU total", "conns/host", "complete", "walls"], rows)
    if before:
        text += f"\n(before: orch from {before})"
    if not mesh:
        text += ("\n(two labs: check `mesh`, the launch host's ssh to every other host, skipped at every size "
                 "and by every tool)")
    return text, records


def projection(records: list[dict], to: int = PROJECT_TO) -> str:
    """orch at `to` hosts, from the per-host figures of the two largest sizes measured."""
    orch = sorted((r for r in records if r["tool"] == "orch"), key=lambda r: r["hosts"])
    if len(orch) < 2:
        return ""
    a, b = orch[-2], orch[-1]
    span = b["hosts"] - a["hosts"]
    cpu_step, wall_step = (b["cpu_s"] - a["cpu_s"]) / span, (b["wall_s"] - a["wall_s"]) / span
    cpu_fixed = a["cpu_s"] - cpu_step * a["hosts"]
    cpu, wall = cpu_fixed + cpu_step * to, b["wall_s"] + wall_step * (to - b["hosts"])
    procs = math.ceil(to / HOSTS_PER_PROC)
    return (f"Projection to {to} hosts (orch): controller CPU {cpu:.1f} s ({1000 * cpu / to:.1f} ms/host: "
            f"{1000 * cpu_step:.1f} ms per host + {cpu_fixed:.2f} s once); wall {wall:.0f} s ({b['wall_s']:.1f} s at "
            f"{b['hosts']} hosts + {1000 * wall_step:.0f} ms per further host).\n"
            f"Assumption: the cost of a host (its connection, key exchange, probe, judging) is the same for every "
            f"host, so controller CPU and wall time grow on the straight line through the {a['hosts']}- and "
            f"{b['hosts']}-host medians (CPU: per-host slope + a fixed start-up share). Every lab host's sshd and "
            f"probe runs on this machine, so the wall slope is mostly THEIR CPU on the shared cores: with real "
            f"hosts the controller's own floor is its CPU over the cores it uses, plus the slowest host's probe. "
            f"orch fans out from one process per {HOSTS_PER_PROC} hosts, at most one per core: with {procs} cores, "
            f"{procs} processes, the busiest (the main one: it also starts up and judges every host) would use "
            f"about {cpu_fixed + cpu_step * to / procs:.1f} s of CPU: the controller's own floor on wall time.")


def verdicts(records: list[dict]) -> list[str]:
    out = []
    by = {(r["hosts"], r["tool"]): r for r in records}
    for n in sorted({r["hosts"] for r in records}):
        o, p = by.get((n, "orch")), by.get((n, "pdsh"))
        c = by.get((n, "pdsh-c25519"))
        for tool in ("before", "orch"):
            t = by.get((n, tool))
            if t and c and n >= 32:  # issue 25: orch check at 32 hosts <= 1.0x pdsh with orch's key exchange
                ok = t["wall_s"] <= c["wall_s"]
                out.append(f"{'MET ' if ok else 'MISS'} {tool} wall <= 1.0x pdsh-c25519 wall at {n} hosts: "
                           f"{t['wall_s']:.2f} s vs {c['wall_s']:.2f} s ({t['wall_s'] / c['wall_s']:.2f}x)")
        if o and p and n >= 32:
            ok = o["wall_s"] <= p["wall_s"]
            out.append(f"{'MET ' if ok else 'MISS'} orch wall <= pdsh wall at {n} hosts: "
                       f"{o['wall_s']:.2f} s vs {p['wall_s']:.2f} s")
        if o and c and n >= 64:
            ok = o["wall_s"] <= 0.8 * c["wall_s"]
            out.append(f"{'MET ' if ok else 'MISS'} orch wall <= 0.8x pdsh-c25519 wall at {n} hosts: "
                       f"{o['wall_s']:.2f} s vs {c['wall_s']:.2f} s ({o['wall_s'] / c['wall_s']:.2f}x)")
        if o and n >= 256:
            ok = o["cpu_ms_per_host"] <= 8
            out.append(f"{'MET ' if ok else 'MISS'} orch controller CPU <= 8 ms/host at {n} hosts: "
                       f"{o['cpu_ms_per_host']:.1f} ms in all its processes "
                       f"({o['main_cpu_ms_per_host']:.1f} ms in the main one)")
        if o:
            ok = o["cpu_ms_per_host"] <= 30
            out.append(f"{'MET ' if ok else 'MISS'} orch controller CPU <= 30 ms/host at {n} hosts: "
                       f"{o['cpu_ms_per_host']:.1f} ms")
            ok = o["conns_per_host"] == "1"
            out.append(f"{'MET ' if ok else 'MISS'} exactly 1 connection per host at {n} hosts: {o['conns_per_host']}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,32,64")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    ap.add_argument("--tools", default=",".join(TOOLS[:4]), help="which of them to run (those installed)")
    ap.add_argument("--before", default=None, metavar="SRC",
                    help="also run `orch check` from this copy of the package (a before/after comparison)")
    ap.add_argument("--lab", default="pbchk", help="the lab's name (reused when it is up with enough hosts)")
    a = ap.parse_args(argv)
    only = [t.strip() for t in a.tools.split(",") if t.strip()]
    unknown = sorted(set(only) - set(TOOLS))
    if unknown:
        ap.error(f"unknown tool(s) {', '.join(unknown)}: choose from {', '.join(TOOLS)}")
    text, records = bench([int(x) for x in a.sizes.split(",")], a.repeat, a.keep, a.lab, only=only, before=a.before)
    print(text)
    print("\n".join(verdicts(records)))
    proj = projection(records)
    if proj:
        print(proj)


if __name__ == "__main__":
    main()
