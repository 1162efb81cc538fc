"""Preflight at scale: `orch check` against pdsh and Ansible running the SAME probe script.

    python tests/benchmarks/bench_check.py [--sizes 8,32,64] [--repeat 3] [--keep]

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

Probes come from `orch check FILE --print-probe HOST`. Reported: median wall time,
controller CPU (user+sys of the command and its children) per host, SSH connections
each host accepted from the controller (sshd logs) and whether every host's probe
output came back complete.
Targets: orch wall <= pdsh wall at 32 and 64 hosts; controller CPU <= 30 ms per host;
exactly 1 controller connection per host.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (  # noqa: E402
    ORCH, SshdCounter, ansible_bin, base_env, conn_summary, fmt, lab_hosts, lab_up, measure, median, pdsh_available,
    pdsh_env, remote_sh, table, write_cluster,
)

END = b"@@orch:end clock1 "


def probes(cluster: Path, names: list[str]) -> dict[str, str]:
    out = {}
    for n in names:
        m = measure(ORCH + ["check", str(cluster), "--print-probe", n], env=base_env()).check("--print-probe")
        out[n] = m.stdout.decode()
    return out


def run_orch(cluster: Path, n: int):
    m = measure(ORCH + ["check", str(cluster), "--json"], env=base_env(), timeout=300)
    try:
        report = json.loads(m.stdout)
        ssh_ok = sum(1 for r in report["results"] if r["check"] == "ssh" and r["status"] == "pass")
        complete = ssh_ok == n and not any(r["status"] in ("fail", "error") for r in report["results"])
    except ValueError:
        complete = False
    return m, complete


def run_pdsh(hosts, launch_probe: str, other_probe: str, kex: str | None = None):
    lab = hosts[0].lab
    env = pdsh_env(lab)
    if kex:
        env["PDSH_SSH_ARGS_APPEND"] += f" -o KexAlgorithms={kex}"
    first, rest = hosts[0], hosts[1:]
    cmds = [f"pdsh -R ssh -f 1 -w {first.address} {shlex.quote(remote_sh(launch_probe))}"]
    if rest:
        cmds.append(f"pdsh -R ssh -f 64 -w {','.join(h.address for h in rest)} {shlex.quote(remote_sh(other_probe))}")
    script = " & ".join(cmds) + "; wait"
    m = measure(["sh", "-c", script], env=env, timeout=300)
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


def bench(sizes: list[int], repeat: int, keep: bool, lab_name: str = "pbchk") -> tuple[str, list[dict]]:
    lab = lab_up(lab_name, max(sizes))
    tools = ["orch"] + (["pdsh", "pdsh-c25519"] if pdsh_available() else []) + (["ansible"] if ansible_bin() else [])
    rows, records = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="orch-bench-check-") as tmp:
            work = Path(tmp)
            for n in sizes:
                hosts = lab_hosts([lab], n)
                cluster = write_cluster(work / f"check{n}.yaml", hosts)
                pr = probes(cluster, [hosts[0].name, hosts[-1].name])
                launch_probe, other_probe = pr[hosts[0].name], pr[hosts[-1].name]
                samples: dict[str, list] = {t: [] for t in tools}
                for rep in range(repeat):
                    order = tools[rep % len(tools):] + tools[:rep % len(tools)]
                    for tool in order:
                        counter = SshdCounter(hosts).start()
                        if tool == "orch":
                            m, complete = run_orch(cluster, n)
                        elif tool == "pdsh":
                            m, complete = run_pdsh(hosts, launch_probe, other_probe)
                        elif tool == "pdsh-c25519":
                            m, complete = run_pdsh(hosts, launch_probe, other_probe, kex="curve25519-sha256")
                        else:
                            m, complete = run_ansible(hosts, launch_probe, other_probe, work)
                        conns = counter.from_controller()
                        samples[tool].append((m, complete, conns))
                        print(f"  check n={n} {tool:8s} rep {rep + 1}: wall {m.wall:6.2f}s cpu {m.cpu:6.2f}s "
                              f"rss {m.maxrss_kb // 1024} MiB conns/host {conn_summary(conns)} "
                              f"complete={complete}", file=sys.stderr, flush=True)
                for tool in tools:
                    s = samples[tool]
                    wall = median([m.wall for m, _, _ in s])
                    cpu = median([m.cpu for m, _, _ in s])
                    rec = {"bench": "check", "hosts": n, "tool": tool, "wall_s": wall, "cpu_s": cpu,
                           "cpu_ms_per_host": 1000 * cpu / n,
                           "maxrss_mib": median([m.maxrss_kb for m, _, _ in s]) / 1024,
                           "conns_per_host": conn_summary([c for _, _, cs in s for c in cs]),
                           "complete": all(c for _, c, _ in s), "walls": [round(m.wall, 2) for m, _, _ in s]}
                    records.append(rec)
                    rows.append([str(n), tool, fmt(wall, " s"), fmt(rec["cpu_ms_per_host"], " ms", 1),
                                 fmt(cpu, " s"), rec["conns_per_host"], "yes" if rec["complete"] else "NO",
                                 " ".join(f"{w:.2f}" for w in rec["walls"])])
    finally:
        if not keep:
            lab.down()
    text = table(["hosts", "tool", "wall (median)", "CPU/host", "CPU total", "conns/host", "complete",
                  "walls"], rows)
    return text, records


def verdicts(records: list[dict]) -> list[str]:
    out = []
    by = {(r["hosts"], r["tool"]): r for r in records}
    for n in sorted({r["hosts"] for r in records}):
        o, p = by.get((n, "orch")), by.get((n, "pdsh"))
        if o and p and n >= 32:
            ok = o["wall_s"] <= p["wall_s"]
            out.append(f"{'MET ' if ok else 'MISS'} orch wall <= pdsh wall at {n} hosts: "
                       f"{o['wall_s']:.2f} s vs {p['wall_s']:.2f} s")
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
    a = ap.parse_args(argv)
    text, records = bench([int(x) for x in a.sizes.split(",")], a.repeat, a.keep)
    print(text)
    print("\n".join(verdicts(records)))


if __name__ == "__main__":
    main()
