"""The simulated cluster behaves like N separate machines reachable over real SSH."""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import subprocess
import uuid
from functools import partial
from pathlib import Path

import pytest
import yaml

from orchestrator import lab as labmod
from orchestrator.errors import LabError
from orchestrator.lab import Lab, render as labrender, system as labsys
from orchestrator.launchers import RUN_VAR
from orchestrator.supervisor import sweep_script
from tests.support import budget, connect_from, lab_cluster, orch, timed, wait_until

pytestmark = pytest.mark.lab
orch_lab = partial(orch, "lab", timeout=120, text=True)  # `orch lab ARGS`, output as text


def system_ssh(lab: Lab, i: int, command: str, connect_timeout: int = 5) -> subprocess.CompletedProcess:
    """Exactly what a user would type: ssh -i KEY -o UserKnownHostsFile=... -o BatchMode=yes root@ADDR CMD."""
    h = lab.host(i)
    argv = ["ssh", "-F", "/dev/null", "-i", str(lab.key_path), "-o", f"UserKnownHostsFile={lab.known_hosts_path}",
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={connect_timeout}",
            f"root@{h.address}", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=connect_timeout + 25)


def accepted(lab: Lab, i: int) -> int:
    return lab.sshd_log(i).read_text().count("Accepted publickey")


def lab_leftovers(name: str, state_dir: Path) -> list[str]:
    """Everything a lab of this name could leave behind."""
    out = []
    ns = [x for x in os.listdir("/run/netns")] if os.path.isdir("/run/netns") else []
    out += [f"netns {x}" for x in ns if re.fullmatch(rf"olab-{name}-\d+", x)]
    out += [f"link {x}" for x in os.listdir("/sys/class/net")
            if re.fullmatch(rf"ol{name}-\d+", x) or x == f"ol-br-{name}"]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(state_dir).encode() + b"/" in cmd:
            out.append(f"process {pid} " + cmd.replace(b"\0", b" ").decode(errors="replace"))
    if state_dir.exists():
        out.append(f"state dir {state_dir}")
    return out


# --------------------------------------------------------------------------- the shared 3-host lab


def test_hosts_are_distinct_machines_over_real_ssh(lab):
    before = [accepted(lab, h.index) for h in lab.hosts]
    seen = {}
    for h in lab.hosts:
        res = system_ssh(lab, h.index, "hostname; ip -4 -o addr show dev eth0; cat /etc/hccn.conf")
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == h.name == f"{lab.name}-h{h.index}"
        assert f"inet {h.address}/24" in lines[1]
        hccn = "\n".join(lines[2:])
        assert re.search(r"^address_0=\d+\.\d+\.\d+\.\d+$", hccn, re.M)
        assert hccn.count("address_") == 8 and hccn.count("netmask_") == 8
        seen[h.index] = (lines[0], h.address, hccn)
    for field in range(3):
        assert len({v[field] for v in seen.values()}) == len(seen)
    # one device index = one subnet across hosts
    dev0 = [re.search(r"address_0=(\d+\.\d+\.\d+)\.", v[2]).group(1) for v in seen.values()]
    assert len(set(dev0)) == 1
    assert [accepted(lab, h.index) for h in lab.hosts] == [b + 1 for b in before]


def test_data_and_tmp_are_private_per_host(lab):
    marker = f"m{uuid.uuid4().hex[:8]}"
    assert system_ssh(lab, 1, f"echo hi > /data/{marker} && echo hi > /tmp/{marker}").returncode == 0
    assert system_ssh(lab, 1, f"cat /data/{marker} /tmp/{marker}").stdout == "hi\nhi\n"
    res = system_ssh(lab, 2, f"ls /data/{marker} /tmp/{marker}")
    assert res.returncode != 0 and "No such file" in res.stderr
    assert not Path(f"/data/{marker}").exists() and not Path(f"/tmp/{marker}").exists()
    assert lab.exec(1, ["cat", f"/data/{marker}"]).stdout == "hi\n"
    assert (lab.host_dir(1) / "data" / marker).exists()


def test_hosts_ssh_to_each_other(lab):
    h2, h3 = lab.host(2), lab.host(3)
    res = system_ssh(lab, 1, f"ssh {h2.address} hostname && ssh {h3.name} hostname")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [h2.name, h3.name]


def test_ssh_sessions_get_the_system_python3_not_the_controllers(lab):
    """A host's python3 is this machine's system one (standard library only), as on a real
    host: never the controller's venv or pyenv python, so orch, paramiko and pydantic are not
    importable there (an import a real host lacks fails in the lab too)."""
    system = labsys.host_python()
    assert os.path.dirname(system) in labrender.SBIN_PATH.split(":")
    probe = ("command -v python3; echo \"$PATH\"; "
             "python3 -c 'import sys; print(sys.executable); print(sys.prefix == sys.base_prefix)'; "
             "for m in orchestrator paramiko pydantic; do "
             "python3 -c \"import $m\" 2>/dev/null && echo \"$m: yes\" || echo \"$m: no\"; done")
    for i in (1, 3):
        res = system_ssh(lab, i, probe)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [
            system, f"/opt/orch-lab/bin:{labrender.SBIN_PATH}", system, "True",  # True: not a venv
            "orchestrator: no", "paramiko: no", "pydantic: no"], res.stdout


def test_mpirun_runs_across_two_lab_hosts(lab):
    h1, h2 = lab.host(1), lab.host(2)
    res = system_ssh(lab, 1, f"mpirun --allow-run-as-root -H {h1.address}:1,{h2.address}:1 -n 2 hostname")
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.split()) == [h1.name, h2.name]


def test_sshd_stop_and_start_keep_the_same_host(lab):
    marker = f"s{uuid.uuid4().hex[:8]}"
    assert system_ssh(lab, 2, f"touch /data/{marker}").returncode == 0
    lab.sshd(2, False)
    try:
        res = system_ssh(lab, 2, "true")
        assert res.returncode == 255 and "Connection refused" in res.stderr
        assert not lab.status()[1].sshd_alive
        r = orch_lab("status", "--name", lab.name)
        assert r.returncode == 0 and re.search(rf"{lab.name}-h2 .* down ", r.stdout)
    finally:
        lab.sshd(2, True)
    res = system_ssh(lab, 2, f"hostname; ls /data/{marker}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [lab.host(2).name, f"/data/{marker}"]


def root_state(pid: int) -> str | None:
    """The state letter of pid out here (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_each_host_has_its_own_pid_namespace(lab):
    tag = uuid.uuid4().hex[:12]
    secs = 100000 + int(tag[:4], 16)  # a sleep argv no other process has
    start = f"{RUN_VAR}={tag} setsid sleep {secs} </dev/null >/dev/null 2>&1 & echo $!"
    res = system_ssh(lab, 1, start)
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout)
    root = lab.root_pid(1, pid)
    try:
        # out here it is a process with another pid, in host 1's PID namespace only
        assert root and root != pid
        assert wait_until(lambda: labmod.pid_alive(root, "sleep"), 5)  # setsid has exec'd sleep
        assert Path(f"/proc/{root}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", str(secs).encode()]
        for i in (1, 2, 3):
            ps = system_ssh(lab, i, "ps -e -o pid=,args=; echo /proc; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
            assert ps.returncode == 0, ps.stderr
            listed, proc = ps.stdout.split("/proc\n")
            rows = [line.split(None, 1) for line in listed.strip().splitlines()]
            # PID 1 is the host's init; a host has only its own handful of processes
            assert rows[0][0] == "1" and rows[0][1].endswith(str(lab.init_path)), rows
            assert len(rows) < 15, rows
            sees = f"sleep {secs}" in listed
            assert sees == (i == 1), (i, listed)
            assert (f"sleep {secs} " in proc) == (i == 1), (i, proc)
            shown = lab.exec(i, ["ps", "-o", "args=", "-p", str(pid)]).stdout.strip()
            assert (shown == f"sleep {secs}") == (i == 1), (i, shown)
        # orch's own "stop this run on this host" on hosts 2 and 3 finds nothing; on host 1 it stops it
        for i in (2, 3):
            res = system_ssh(lab, i, sweep_script(tag, "TERM", grace=2))
            assert res.stdout.strip() == "none", (i, res.stdout, res.stderr)
        assert labmod.pid_alive(root, "sleep")
        res = system_ssh(lab, 1, sweep_script(tag, "TERM", grace=2))
        assert res.stdout.strip() == "stopped", res.stdout + res.stderr
        assert wait_until(lambda: not labmod.pid_alive(root), 5)
    finally:
        system_ssh(lab, 1, f"kill -9 {pid} 2>/dev/null")


def test_killed_orphans_are_reaped_not_left_as_zombies(lab):
    # a daemon whose parent exits at once: the host's init adopts it
    res = system_ssh(lab, 3, "sh -c 'sleep 300 </dev/null >/dev/null 2>&1 & echo $!'")
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout)
    root = lab.root_pid(3, pid)
    assert root and wait_until(lambda: labmod.pid_alive(root, "sleep"), 5)
    ps = system_ssh(lab, 3, f"ps -o ppid=,stat=,comm= -p {pid}; ps -o comm= -p 1")
    assert ps.stdout.split() == ["1", "S", "sleep", labmod.HOLDER_COMM], ps.stdout
    assert system_ssh(lab, 3, f"kill -9 {pid}").returncode == 0

    # the host's init reaps it at once (this machine's PID 1 might take its time, or never)
    reaped = wait_until(lambda: system_ssh(lab, 3, f"ps -o stat= -p {pid} || echo reaped").stdout.strip() == "reaped",
                      timeout=2)
    assert reaped, f"pid {pid} on host 3 was not reaped: {system_ssh(lab, 3, f'ps -o stat= -p {pid}').stdout}"
    assert root_state(root) != "Z"
    # the same through Lab.exec, whose ps shows the host's view too
    out = lab.exec(3, ["sh", "-c", "sleep 300 </dev/null >/dev/null 2>&1 & echo $!"]).stdout
    pid = int(out)
    assert lab.exec(3, ["ps", "-o", "ppid=", "-p", str(pid)]).stdout.strip() == "1"
    lab.exec(3, ["kill", "-9", str(pid)])
    assert wait_until(lambda: lab.exec(3, ["ps", "-o", "stat=", "-p", str(pid)]).returncode == 1, timeout=3)


def test_exec_timeout_leaves_nothing_behind(lab):
    tag = uuid.uuid4().hex[:8]
    with pytest.raises(LabError, match="timed out"):
        lab.exec(2, ["sh", "-c", f"exec sleep 2{int(tag[:4], 16)}"], timeout=0.5)
    listed = lab.exec(2, ["ps", "-e", "-o", "stat=,args="]).stdout
    assert f"sleep 2{int(tag[:4], 16)}" not in listed and not re.search(r"^Z", listed, re.M), listed


def test_link_down_makes_host_unreachable_until_up(lab):
    _, healthy = timed(system_ssh, lab, 3, "true", connect_timeout=2)
    r = orch_lab("link", "down", "3", "--name", lab.name)
    assert r.returncode == 0, r.stderr
    try:
        res, took = timed(system_ssh, lab, 3, "true", connect_timeout=2)
        assert res.returncode == 255
        assert took < budget(healthy, 2)  # ssh's ConnectTimeout, not TCP's own minutes
        assert not lab.status()[2].link_up
        assert system_ssh(lab, 1, f"ssh -o ConnectTimeout=2 {lab.host(3).address} true").returncode != 0
    finally:
        assert orch_lab("link", "up", "3", "--name", lab.name).returncode == 0
    assert lab.status()[2].link_up
    res = system_ssh(lab, 3, "hostname")
    assert res.returncode == 0 and res.stdout.strip() == lab.host(3).name


def test_status_output(lab):
    r = orch_lab("status", "--name", lab.name)
    assert r.returncode == 0, r.stderr
    for h in lab.hosts:
        assert re.search(rf"^{h.name}\s+{re.escape(h.address)}\s+{h.netns}\s+up \(pid \d+\)\s+up$", r.stdout, re.M), \
            r.stdout
    assert r.stdout.rstrip().endswith(f"inventory: {lab.inventory_path}")
    assert all(s.ok for s in lab.status())
    doc = json.loads(orch("lab", "status", "--name", lab.name, "--json").stdout)
    assert doc["up"] and doc["inventory"] == str(lab.inventory_path) and doc["bastion"] is None
    assert [(h["name"], h["address"], h["sshd"], h["link"], h["netns_up"]) for h in doc["hosts"]] == [
        (h.name, h.address, True, True, True) for h in lab.hosts]
    assert json.loads(orch("lab", "status", "--name", "zzgone", "--json").stdout) == {
        "name": "zzgone", "up": False, "hosts": []}


def test_inventory_is_a_contract_inventory(lab):
    inv = yaml.safe_load(lab.inventory_path.read_text())
    assert set(inv) == {"defaults", "hosts"}
    assert inv["defaults"] == {"user": "root", "port": 22, "identity_file": str(lab.key_path),
                               "known_hosts": str(lab.known_hosts_path), "slots": 2}
    assert inv["hosts"] == [{"address": h.address, "name": h.name} for h in lab.hosts]
    known = lab.known_hosts_path.read_text()
    assert all(h.address in known for h in lab.hosts)
    state = lab.state()
    assert re.fullmatch(r"198\.18\.\d+\.0/24", state["subnet"])
    assert all(h.address.startswith(state["subnet"].rsplit(".", 1)[0] + ".") for h in lab.hosts)


# --------------------------------------------------------------------------- --vary / --refuse-key


VARY = ["--all", "mindspore=2.10.0",
        "--vary", "2:openmpi=4.0.3", "--vary", "2:python=3.10.14", "--vary", "2:mindspore=2.2.14",
        "--vary", "2:nccl=2.18.3", "--vary", "3:openmpi=none", "--refuse-key", "4"]
PROBE = ("python3 -c 'import importlib.metadata as m; print(m.version(\"mindspore\"))'; "
         "python3 --version; mpirun --version | head -1; "
         "command -v mpirun >/dev/null && echo has-mpirun || echo no-mpirun; "
         "ls ${LD_LIBRARY_PATH:-/nonexistent} 2>/dev/null | grep nccl || echo no-nccl")


@pytest.fixture(scope="module")
def varied(lab_factory):
    name = lab_factory.name("v")
    r = orch_lab("up", "4", "--name", name, *VARY)
    lab = Lab(name)
    yield r, lab
    lab.down()


def test_vary_shows_through_ssh(varied):
    r, lab = varied
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(lab.inventory_path)
    out = {i: system_ssh(lab, i, PROBE) for i in (1, 2, 3)}
    assert all(res.returncode == 0 for res in out.values()), {i: o.stderr for i, o in out.items()}
    h1, h2, h3 = (out[i].stdout.splitlines() for i in (1, 2, 3))
    system_python = subprocess.run([labsys.host_python(), "--version"], capture_output=True, text=True).stdout.strip()
    real_mpirun = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert h1 == ["2.10.0", system_python, real_mpirun, "has-mpirun",
                  "no-nccl"]
    assert h2 == ["2.2.14", "Python 3.10.14", "mpirun (Open MPI) 4.0.3", "has-mpirun",
                  "libnccl.so.2", "libnccl.so.2.18.3"]
    assert h3[-2:] == ["no-mpirun", "no-nccl"] and h3[0] == "2.10.0"
    info = system_ssh(lab, 2, "ompi_info | grep -E '^ +Open MPI:'")
    assert info.stdout.split() == ["Open", "MPI:", "4.0.3"]
    assert system_ssh(lab, 3, "command -v orted || command -v ompi_info").returncode == 1


def test_refuse_key_host_refuses(varied):
    _, lab = varied
    res = system_ssh(lab, 4, "true")
    assert res.returncode == 255 and "Permission denied (publickey)" in res.stderr
    assert system_ssh(lab, 1, "true").returncode == 0


# --------------------------------------------------------------------------- replace, down, errors


def test_up_replaces_and_down_leaves_nothing(lab, lab_factory):
    w = lab_factory("w", 3)
    name, sd = w.name, w.state_dir
    old_holders = [h["holder_pid"] for h in w.state()["hosts"]]
    # a daemon started over ssh (setsid, detached) must not survive replace or down
    daemon = "sh -c 'setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!'"
    pid = w.root_pid(2, int(system_ssh(w, 2, daemon).stdout))  # $! is host 2's pid
    assert wait_until(lambda: labmod.pid_alive(pid, "sleep"), 5)  # once setsid has exec'd sleep

    r = orch_lab("up", "2", "--name", name)  # someone's lab: not replaced without --replace
    assert r.returncode == 1 and "already up (3 hosts" in r.stderr and "--replace" in r.stderr, r.stderr
    assert len(w.hosts) == 3 and all(labmod.pid_alive(p) for p in old_holders)
    r = orch_lab("up", "2", "--name", name, "--replace")
    assert r.returncode == 0, r.stderr
    assert len(w.hosts) == 2
    assert not any(labmod.pid_alive(p) for p in old_holders)
    assert not os.path.exists(f"/run/netns/olab-{name}-3")
    assert not labmod.pid_alive(pid)
    pid = w.root_pid(2, int(system_ssh(w, 2, daemon).stdout))
    assert wait_until(lambda: labmod.pid_alive(pid, "sleep"), 5)
    holders = [h["holder_pid"] for h in w.state()["hosts"]]

    r = orch_lab("down", "--name", name)
    assert r.returncode == 0, r.stderr
    assert lab_leftovers(name, sd) == []
    assert not any(labmod.pid_alive(p) for p in holders + [pid])
    r = orch_lab("down", "--name", name)
    assert r.returncode == 0 and "nothing to remove" in r.stdout

    # the other lab, sharing the mountpoints on the real fs, is untouched
    marker = f"k{uuid.uuid4().hex[:8]}"
    assert system_ssh(lab, 1, f"echo ok > /data/{marker} && cat /data/{marker}").stdout == "ok\n"


def test_errors_are_lab_errors_naming_the_fix(lab, monkeypatch):
    r = orch_lab("sshd", "stop", "9", "--name", lab.name)
    assert r.returncode == 1
    assert r.stderr.startswith("orch: error: lab ") and "no host 9" in r.stderr and "Traceback" not in r.stderr
    r = orch_lab("up", "2", "--name", "Bad_Name")
    assert r.returncode == 1 and "bad lab name" in r.stderr
    with pytest.raises(LabError, match="I:TOOL=VERSION"):
        labmod.parse_vary(["openmpi=4.0.3"])
    with pytest.raises(LabError, match="hosts 1..2"):
        Lab("tzz").up(2, vary=["5:openmpi=4.0.3"])

    real_which = labsys.which
    for tool, package in [("mpirun", "openmpi-bin"), ("sshd", "openssh-server"), ("ip", "iproute2"),
                          ("nsenter", "util-linux")]:
        monkeypatch.setattr(labsys, "which", lambda t, _tool=tool: None if t == _tool else real_which(t))
        with pytest.raises(LabError) as exc:
            labmod.preflight()
        assert f"apt-get install {package}" in str(exc.value)
    monkeypatch.setattr(labsys, "which", real_which)
    monkeypatch.setattr(labsys.os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match="needs root"):
        Lab("t0").status()
    monkeypatch.setattr(labsys.sys, "platform", "darwin")
    with pytest.raises(LabError, match="needs Linux"):
        labmod.preflight()


def test_two_named_labs_get_distinct_subnets(lab, varied):
    _, v = varied
    assert lab.state()["k"] != v.state()["k"]
    assert not set(h.address for h in lab.hosts) & set(h.address for h in v.hosts)


# --------------------------------------------------------------------------- --ssh-port / --user / --bastion


PORT, USER = 2222, "train"


def hb_name(suffix: str = "") -> str:
    return f"hb{os.getpid() % 100000}{suffix}"


def cfg_ssh(lab: Lab, alias: str, command: str, timeout: float = 40) -> subprocess.CompletedProcess:
    """What a user would type with the lab's ssh_config: ssh -F FILE ALIAS CMD."""
    return subprocess.run(["ssh", "-F", str(lab.ssh_config_path), alias, command], capture_output=True, text=True,
                          timeout=timeout)


def bastion_leftovers(name: str, state_dir: Path, route: str) -> list[str]:
    out = lab_leftovers(name, state_dir)
    out += [f"link {x}" for x in os.listdir("/sys/class/net") if re.fullmatch(rf"ol{name}-\d+b?|ol-bh-{name}", x)
            and f"link {x}" not in out]
    res = subprocess.run(["ip", "-4", "route", "show", "type", "unreachable", route], capture_output=True, text=True)
    if res.stdout.strip():
        out.append(f"route {res.stdout.strip()}")
    return out


@pytest.fixture(scope="module")
def behind(lab_factory):
    """Two hosts behind a bastion, every sshd on PORT, the inventory's user USER."""
    lab = Lab(hb_name())
    try:
        yield lab.up(2, ssh_port=PORT, user=USER, bastion=True)
    finally:
        lab.down()


def test_options_write_inventory_known_hosts_and_ssh_config(behind):
    b, hosts, st = behind.bastion, behind.hosts, behind.state()
    inv = yaml.safe_load(behind.inventory_path.read_text())
    assert inv["defaults"] == {"user": USER, "port": PORT, "identity_file": str(behind.key_path),
                               "known_hosts": str(behind.known_hosts_path), "slots": 2,
                               "jump": f"{USER}@{b.address}:{PORT}"}
    assert inv["hosts"] == [{"address": h.address, "name": h.name} for h in hosts]
    assert (st["ssh_port"], st["user"], behind.ssh_port, behind.user) == (PORT, USER, PORT, USER)
    assert behind.host(0) == b and b.index == 0 and b.name == f"{behind.name}-bastion"
    # the bastion's address is on this machine's subnet, the hosts are on another, reserved one
    assert b.address.startswith(st["subnet"].rsplit(".", 1)[0] + ".")
    assert st["bastion"]["subnet"] == st["hosts_subnet"] == behind.hosts_subnet != st["subnet"]
    assert all(h.address.startswith(st["hosts_subnet"].rsplit(".", 1)[0] + ".") for h in hosts)
    known = behind.known_hosts_path.read_text().splitlines()
    for h in hosts + [b]:
        line = next(ln for ln in known if ln.startswith(f"[{h.address}]:{PORT},"))
        assert f"[{h.name}]:{PORT}" in line.split()[0].split(",")
    assert not any(h.address in ln.split()[0].split(",") for h in hosts for ln in known)  # no port-22 form
    # OpenSSH's own reading of the config
    for h in hosts:
        res = subprocess.run(["ssh", "-G", "-F", str(behind.ssh_config_path), h.name], capture_output=True,
                             text=True, timeout=10)
        conf = dict(ln.split(" ", 1) for ln in res.stdout.splitlines() if " " in ln)
        assert (conf["hostname"], conf["user"], conf["port"], conf["proxyjump"]) == (h.address, USER, str(PORT),
                                                                                     b.name)
        assert conf["identityfile"] == str(behind.key_path)
        assert conf["userknownhostsfile"] == str(behind.known_hosts_path)
        assert (conf["stricthostkeychecking"], conf["batchmode"]) == ("true", "yes")


def test_only_the_bastion_is_reachable_and_its_log_shows_each_connection(behind):
    b = behind.bastion
    for h in behind.hosts:
        for port in (PORT, 22):
            with pytest.raises(OSError):
                socket.create_connection((h.address, port), timeout=3).close()
    socket.create_connection((b.address, PORT), timeout=3).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((b.address, 22), timeout=3).close()
    assert behind.exec(0, ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "0"

    gateway = behind.state()["gateway"]

    def through_bastion() -> int:
        return behind.bastion_sshd_log.read_text().count(f"Accepted publickey for {USER} from {gateway} ")

    before = through_bastion()
    for h in behind.hosts:
        res = cfg_ssh(behind, h.name, "hostname")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == h.name
    assert through_bastion() == before + len(behind.hosts)


def test_user_is_an_ordinary_account_owning_data(behind):
    h1 = behind.host(1)
    marker = f"u{uuid.uuid4().hex[:8]}"
    res = cfg_ssh(behind, h1.name, f"id -u; id -g; id -un; echo $HOME; stat -c '%u %a' ~/.ssh ~/.ssh/id_ed25519; "
                                   f"stat -c %U /data; mkdir /data/{marker} && stat -c %U /data/{marker}; "
                                   f"touch ~/{marker}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n") == ["4300", "4300", USER, f"/home/{USER}", "4300 700", "4300 600", USER, USER, ""]
    # the inventory's key and user with the lab helpers; root login still works
    assert behind.ssh(2, "id -u", user=USER).stdout == "4300\n"
    assert behind.ssh(2, "id -u").stdout == "0\n"
    # homes are per host; this machine has no such user
    assert behind.ssh(2, f"ls ~/{marker}", user=USER).returncode != 0
    assert behind.exec(1, ["ls", f"/home/{USER}/{marker}"]).returncode == 0
    with pytest.raises(KeyError):
        pwd.getpwuid(4300)
    assert not Path(f"/home/{USER}").exists()


def test_hosts_ssh_to_each_other_as_the_user_on_the_port(behind):
    h1, h2 = behind.host(1), behind.host(2)
    res = cfg_ssh(behind, h1.name, f"ssh -p {PORT} {h2.address} id -un && ssh -p {PORT} {h2.name} hostname && "
                                   f"{{ ssh {h2.name} true 2>&1; echo rc=$?; }}")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[:2] == [USER, h2.name]
    assert "Connection refused" in res.stdout and lines[-1] == "rc=255"  # ~/.ssh/config sets no port
    res = cfg_ssh(behind, h1.name, f"mpirun -mca plm_rsh_args '-p {PORT}' -H {h1.address}:1,{h2.address}:1 "
                                   "-n 2 hostname", timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.stdout.split()) == [h1.name, h2.name]


def test_status_exec_sshd_and_link_cover_the_bastion(behind):
    b = behind.bastion
    r = orch_lab("status", "--name", behind.name)
    assert r.returncode == 0, r.stderr
    assert re.search(rf"^{b.name}\s+{re.escape(b.address)}\s+{b.netns}\s+up \(pid \d+\)\s+up$", r.stdout, re.M), \
        r.stdout
    assert f"ssh_config: {behind.ssh_config_path}" in r.stdout
    st = behind.status()
    assert [s.host for s in st] == behind.hosts + [b] and all(s.ok for s in st)
    assert behind.exec(0, ["hostname"]).stdout.strip() == b.name

    r = orch_lab("sshd", "stop", "0", "--name", behind.name)
    assert r.returncode == 0, r.stderr
    try:
        assert behind.ssh(1, "true").returncode == 255
        assert not behind.status()[-1].sshd_alive
    finally:
        behind.sshd(0, True)
    assert behind.ssh(1, "hostname", user=USER).stdout.strip() == behind.host(1).name

    behind.link(0, False)
    try:
        assert behind.ssh(2, "true", connect_timeout=2).returncode == 255
        assert not behind.status()[-1].link_up
    finally:
        behind.link(0, True)
    assert behind.status()[-1].link_up
    assert cfg_ssh(behind, behind.host(2).name, "hostname").stdout.strip() == behind.host(2).name


def test_bastion_lab_from_the_cli_and_down_leaves_nothing(lab_factory):
    name = hb_name("d")
    lab = Lab(name)
    try:
        r = orch_lab("up", "1", "--name", name, "--bastion")
        assert r.returncode == 0, r.stderr
        out = r.stdout.strip().splitlines()
        assert out[-1] == str(lab.inventory_path) and str(lab.ssh_config_path) in out[-2]
        b, h = lab.bastion, lab.host(1)
        inv = yaml.safe_load(lab.inventory_path.read_text())
        assert inv["defaults"]["jump"] == f"root@{b.address}:22"
        assert (inv["defaults"]["user"], inv["defaults"]["port"]) == ("root", 22)
        assert f"{h.address},{h.name} ssh-ed25519 " in lab.known_hosts_path.read_text()
        res = cfg_ssh(lab, h.name, "hostname; id -u")
        assert res.returncode == 0 and res.stdout.split() == [h.name, "0"], res.stderr
        route = lab.hosts_subnet
        assert bastion_leftovers(name, lab.state_dir, route) != []

        r = orch_lab("down", "--name", name)
        assert r.returncode == 0, r.stderr
        assert bastion_leftovers(name, lab.state_dir, route) == []
        assert name not in labmod.list_labs()
    finally:
        lab.down()


# --------------------------------------------------------------------------- --dual-homed-head


def test_dual_homed_head_only_host_1_is_reachable_and_the_others_through_it(dual_homed_lab, tmp_path):
    """Network A: this machine and host 1. Network B: host 1 again and hosts 2..3, which this
    machine reaches only through host 1 (the inventory's jump, ssh_config's ProxyJump), and
    which reach host 1 on its B address only."""
    lab = dual_homed_lab
    h1, st = lab.host(1), lab.state()
    a_net, b_net = st["subnet"], st["hosts_subnet"]
    assert a_net != b_net and lab.subnet == a_net and lab.hosts_subnet == b_net
    a_pre, b_pre = a_net.rsplit(".", 1)[0] + ".", b_net.rsplit(".", 1)[0] + "."
    head_b = lab.peer_address(1)
    assert (h1.address, head_b) == (a_pre + "11", b_pre + "11") and lab.jump_host == h1
    others = lab.hosts[1:]
    assert [h.address for h in others] == [b_pre + "12", b_pre + "13"]
    assert all(lab.peer_address(h.index) == h.address for h in others)

    # the controller: host 1 on A, directly; nothing on B
    res = system_ssh(lab, 1, "hostname; ip -4 -o addr show | awk '{print $2, $4}'")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:4] == [h1.name, "lo 127.0.0.1/8", f"eth0 {h1.address}/24", f"eth1 {head_b}/24"]
    for address in [head_b] + [h.address for h in others]:
        with pytest.raises(OSError):
            socket.create_connection((address, 22), timeout=3).close()
    assert system_ssh(lab, 2, "true", connect_timeout=3).returncode == 255
    # ... but hosts 2..3 through host 1, by the lab's helpers and by ssh_config's aliases
    before = accepted(lab, 1)
    for h in others:
        assert lab.ssh(h.index, "hostname").stdout.strip() == h.name
        res = cfg_ssh(lab, h.name, "hostname; ip -4 -o addr show dev eth0")
        assert res.returncode == 0 and res.stdout.split()[0] == h.name and f"{h.address}/24" in res.stdout, res.stderr
        assert f" {a_pre}" not in res.stdout  # hosts 2..3 have no address on A
    assert accepted(lab, 1) == before + 2 * len(others)  # each of those went through host 1's sshd

    # host 2 reaches host 1 on B (its sshd listens there), never on A; nor this machine
    assert connect_from(lab, 2, head_b, 22) == "ok"
    assert "unreachable" in connect_from(lab, 2, h1.address, 22)
    assert "unreachable" in connect_from(lab, 2, st["gateway"], 22)
    assert connect_from(lab, 1, lab.host(3).address, 22) == "ok"
    assert lab.exec(1, ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "0"
    # over ssh as mpirun would: host 2 names host 1 by its B address (/etc/hosts, known_hosts)
    res = lab.ssh(2, f"getent hosts {h1.name}; ssh {h1.name} hostname; ssh {head_b} hostname; "
                     f"ssh -o ConnectTimeout=3 {h1.address} true 2>&1 | tail -1")
    lines = res.stdout.splitlines()
    assert [lines[0].split(), *lines[1:3]] == [[head_b, h1.name], h1.name, h1.name], res.stdout + res.stderr
    assert "unreachable" in lines[3], lines

    # the inventory: host 1 by its A address, no jump, no mpi_address; the others through it
    inv = yaml.safe_load(lab.inventory_path.read_text())
    assert "jump" not in inv["defaults"]
    assert inv["hosts"] == [{"address": h1.address, "name": h1.name}] + [
        {"address": h.address, "name": h.name, "jump": f"root@{h1.address}:22"} for h in others]
    cluster = lab_cluster(lab, tmp_path)
    assert [(h.address, h.mpi_address, [j.address for j in h.jump]) for h in cluster.hosts] == [
        (h1.address, None, [])] + [(h.address, None, [h1.address]) for h in others]
    known = lab.known_hosts_path.read_text()
    assert f"{h1.address},{head_b},{h1.name} ssh-ed25519 " in known

    # status names the topology
    r = orch_lab("status", "--name", lab.name)
    assert r.returncode == 0 and f"{h1.name} also {head_b} there" in r.stdout and "ssh_config:" in r.stdout, r.stdout
    doc = json.loads(orch_lab("status", "--name", lab.name, "--json").stdout)
    assert doc["dual_homed_head"] == {"name": h1.name, "address": h1.address, "back_address": head_b,
                                      "subnet": b_net, "bridge": f"ol-bh-{lab.name}"}
    assert doc["bastion"] is None and doc["ssh_config"] == str(lab.ssh_config_path)
    assert all(s.ok for s in lab.status())


def test_dual_homed_head_from_the_cli_as_a_user_on_a_port_and_down_leaves_nothing(lab_factory):
    name = hb_name("h")
    lab = Lab(name)
    try:
        r = orch_lab("up", "2", "--name", name, "--dual-homed-head", "--user", USER, "--ssh-port", str(PORT))
        assert r.returncode == 0, r.stderr
        out = r.stdout.strip().splitlines()
        assert out[-1] == str(lab.inventory_path) and str(lab.ssh_config_path) in out[-2], out
        h1, h2 = lab.host(1), lab.host(2)
        assert f"also {lab.peer_address(1)} on network B" in r.stdout
        inv = yaml.safe_load(lab.inventory_path.read_text())
        assert inv["hosts"][1]["jump"] == f"{USER}@{h1.address}:{PORT}" and "jump" not in inv["hosts"][0]
        res = cfg_ssh(lab, h2.name, f"id -un; hostname; ssh -p {PORT} {h1.name} hostname")
        assert res.returncode == 0 and res.stdout.split() == [USER, h2.name, h1.name], res.stderr
        route = lab.hosts_subnet
        left = bastion_leftovers(name, lab.state_dir, route)
        assert f"link ol{name}-1b" in left and f"link ol-bh-{name}" in left and f"route unreachable {route}" in left

        r = orch_lab("down", "--name", name)
        assert r.returncode == 0, r.stderr
        assert bastion_leftovers(name, lab.state_dir, route) == []
        assert name not in labmod.list_labs()
    finally:
        lab.down()


def test_option_errors():
    with pytest.raises(LabError, match="--slurm and --bastion"):
        Lab(hb_name("z")).up(1, slurm=True, bastion=True)
    with pytest.raises(LabError, match="--bastion and --dual-homed-head"):
        Lab(hb_name("z")).up(2, bastion=True, dual_homed_head=True)
    with pytest.raises(LabError, match="--slurm and --dual-homed-head"):
        Lab(hb_name("z")).up(2, slurm=True, dual_homed_head=True)
    with pytest.raises(LabError, match="bad ssh port"):
        Lab(hb_name("z")).up(1, ssh_port=70000)
    with pytest.raises(LabError, match="bad lab user name"):
        Lab(hb_name("z")).up(1, user="Bad User")
    with pytest.raises(LabError, match="already has 'root'"):
        labrender.passwd_with_user("root:x:0:0::/root:/bin/sh\n", "root", "/home/root", "/bin/sh")
