"""`orch check` against the simulated cluster: real sshd, real mpirun, per-host versions.

One 6-host lab (its own name, chk<pid>), torn down at the end of the module:
  h1, h2  uniform (mindspore 2.10.0 everywhere, the machine's Open MPI and python)
  h3      mindspore 2.2.14
  h4      openmpi 4.0.3
  h5      refuses the lab key
  h6      openmpi=none (no mpirun/orted)
Each test picks its hosts with --hosts. Skips only where no lab can be made (never with CI set).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import _require_lab
from tests.support import REPO, budget, orch, sshd_lines

pytestmark = pytest.mark.lab

NAME = f"chk{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def lab():
    _require_lab()
    from orchestrator.lab import Lab

    lab = Lab(NAME)
    try:
        lab.up(6, vary=["*:mindspore=2.10.0", "3:mindspore=2.2.14", "4:openmpi=4.0.3", "6:openmpi=none"],
               refuse_key=[5])
        yield lab
    finally:
        lab.down()


def h(lab, *idx: int) -> str:
    return ",".join(lab.host_name(i) for i in idx)


def write(lab, tmp_path: Path, ssh: dict | None = None, **job) -> Path:
    (tmp_path / "train.py").write_text("print('train')\n")
    doc = {
        "inventory": str(lab.inventory_path),
        "ssh": {"connect_timeout": 2, "retries": 2, "command_timeout": 30, **(ssh or {})},
        "job": {"workdir": "/data/chk", "command": "python3 train.py", "sync": ["train.py"], **job},
        "checks": {"versions": ["python", "openmpi", "mindspore"]},
    }
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return f


def orch_check(f: Path, *args: str, timeout: float = 60, env: dict | None = None
               ) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = orch("check", f, *args, cwd=f.parent, timeout=timeout, text=True, env={"PYTHONPATH": str(REPO), **(env or {})})
    return res, time.monotonic() - t0


def results(res: subprocess.CompletedProcess) -> dict:
    doc = json.loads(res.stdout)  # the whole of stdout is one JSON object
    assert set(doc) == {"ok", "results"}
    for r in doc["results"]:
        assert set(r) == {"check", "host", "status", "message"}
    return doc


def by(doc: dict, check: str, host: str | None = "any") -> list[dict]:
    return [r for r in doc["results"] if r["check"] == check and (host == "any" or r["host"] == host)]


def test_uniform_hosts_pass(lab, tmp_path):
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 2), "--json")
    doc = results(res)
    assert res.returncode == 0 and doc["ok"] is True, res.stdout + res.stderr
    bad = [r for r in doc["results"] if r["status"] not in ("pass", "warn")]
    assert not bad
    (v,) = [r for r in by(doc, "versions") if r["status"] == "pass"]
    assert "mindspore 2.10.0" in v["message"] and v["host"] is None
    assert by(doc, "mesh", lab.host_name(1))[0]["status"] == "pass"
    # the table view exits the same way and shows each host
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 2))
    assert res.returncode == 0 and lab.host_name(2) in res.stdout


def test_version_mismatch_names_versions_and_hosts(lab, tmp_path):
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 2, 3, 4), "--json")
    doc = results(res)
    assert res.returncode == 1 and doc["ok"] is False
    fails = {r["message"] for r in by(doc, "versions", None) if r["status"] == "fail"}
    n = lab.name
    assert f"mindspore: 2.10.0 on {n}-h[1-2,4]; 2.2.14 on {n}-h3" in fails
    assert f"openmpi: 4.1.4 on {n}-h[1-3]; 4.0.3 on {n}-h4" in fails
    # the table view lists each problem once
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 2, 3, 4))
    assert res.returncode == 1 and res.stdout.count("2.2.14 on") == 1


def test_refused_key_fails_fast_and_the_others_pass(lab, tmp_path):
    f = write(lab, tmp_path, ssh={"connect_timeout": 5, "retries": 3})
    _, healthy = orch_check(f, "--hosts", h(lab, 1, 2), "--json", "--full-mesh")
    controller = str(ipaddress.ip_network(lab.subnet).network_address + 1)  # where the lab sees this machine

    def tries() -> int:  # connections to h5 from here: one, however many retries ssh.retries allows
        return sum(f"Connection from {controller} port " in line for line in sshd_lines(lab, 5))

    before = tries()
    res, took = orch_check(f, "--hosts", h(lab, 1, 2, 5), "--json", "--full-mesh")
    assert tries() - before == 1, "an auth failure is not retried"
    doc = results(res)
    h1, h2, h5 = (lab.host_name(i) for i in (1, 2, 5))
    assert res.returncode == 1
    (ssh5,) = by(doc, "ssh", h5)
    assert ssh5["status"] == "fail" and "ssh-copy-id" in ssh5["message"] and "root@" in ssh5["message"]
    assert took < budget(healthy, 0), \
        f"an auth failure is not retried (took {took:.1f}s, {healthy:.1f}s without h5; connect_timeout 5 x 3)"
    assert all(r["status"] == "error" for r in doc["results"] if r["host"] == h5 and r["check"] != "ssh")
    for name in (h1, h2):
        for r in doc["results"]:
            if r["host"] == name and r["check"] != "mesh":
                assert r["status"] in ("pass", "warn"), r
        (mesh,) = by(doc, "mesh", name)  # mpirun's own ssh would fail the same way
        assert mesh["status"] == "fail" and h5 in mesh["message"] and "Permission denied" in mesh["message"]
    assert [r["status"] for r in by(doc, "versions", None)] == ["pass"]


def test_missing_openmpi_fails_path(lab, tmp_path):
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 6), "--json")
    doc = results(res)
    n6 = lab.host_name(6)
    (p,) = by(doc, "path", n6)
    assert p["status"] == "fail" and "mpirun, orted not found" in p["message"] and "--prefix" in p["message"]
    assert by(doc, "path", lab.host_name(1))[0]["status"] == "pass"
    assert any(r["message"] == f"openmpi: 4.1.4 on {lab.host_name(1)}; not installed on {n6}"
               for r in by(doc, "versions", None))


def _accepted(lab, i: int) -> int:
    gateway = lab.state()["gateway"]
    try:
        log = lab.sshd_log(i).read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for ln in log.splitlines() if "Accepted publickey" in ln and f" from {gateway} " in ln)


def test_one_ssh_connection_per_host(lab, tmp_path):
    before = [_accepted(lab, i) for i in (1, 2, 3)]
    res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 1, 2, 3), "--json")
    results(res)
    time.sleep(0.2)  # sshd logs asynchronously
    after = [_accepted(lab, i) for i in (1, 2, 3)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    # and in-process, from the transports themselves
    from orchestrator import checks
    from orchestrator.spec import load_cluster
    from orchestrator.transport import Pool

    c = load_cluster(write(lab, tmp_path)).select(h(lab, 1, 2, 3))
    with Pool(c) as pool:
        checks.run_checks(c, pool)
        assert [pool[x].connections_opened for x in c.hosts] == [1, 1, 1]


def test_several_fanout_processes_give_the_same_report(lab, tmp_path):
    """Past ~128 hosts `orch check` fans out from several processes (shards.py); forced here on 6
    hosts (ORCH_FANOUT_PROCS=3): the same results (timings aside), exit code and table as one
    process, still one connection per host, the launch host's mesh test included."""
    import re

    def same(text: str) -> str:
        # timings, and free space (the machine's other work writes to the same disk meanwhile)
        return re.sub(r"\d+(\.\d+)? ?(ms|s|[KMGT]iB)\b", "T", text)

    f = write(lab, tmp_path)
    hosts = h(lab, 1, 2, 3, 4, 5, 6)
    orch_check(f, "--hosts", hosts, "--json")  # the first check creates the workdir; the next two say it is there
    time.sleep(0.2)
    before = [_accepted(lab, i) for i in range(1, 7)]
    runs = {n: orch_check(f, "--hosts", hosts, "--json", env={"ORCH_FANOUT_PROCS": n})[0] for n in ("1", "3")}
    time.sleep(0.2)  # sshd logs asynchronously
    after = [_accepted(lab, i) for i in range(1, 7)]
    one, three = (results(runs[n]) for n in ("1", "3"))
    assert runs["3"].returncode == runs["1"].returncode == 1
    assert same(json.dumps(three)) == same(json.dumps(one))
    assert {r["host"] for r in three["results"] if r["check"] == "ssh" and r["status"] == "pass"} == \
        {lab.host_name(i) for i in (1, 2, 3, 4, 6)}
    assert by(three, "mesh", lab.host_name(1))[0]["status"] == "fail"  # h5 refuses the key: mpirun's ssh too
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2, 2, 2, 0, 2]  # one per run
    tables = [orch_check(f, "--hosts", hosts, env={"ORCH_FANOUT_PROCS": n})[0] for n in ("1", "3")]
    assert [t.returncode for t in tables] == [1, 1] and same(tables[0].stdout) == same(tables[1].stdout)


def test_stopped_sshd_reported_within_connect_budget(lab, tmp_path):
    f = write(lab, tmp_path, ssh={"connect_timeout": 1, "retries": 2})
    _, healthy = orch_check(f, "--hosts", h(lab, 1, 2), "--json")
    lab.sshd(2, False)
    try:
        res, took = orch_check(f, "--hosts", h(lab, 1, 2), "--json")
    finally:
        lab.sshd(2, True)
    doc = results(res)
    (s,) = by(doc, "ssh", lab.host_name(2))
    assert res.returncode == 1 and s["status"] == "fail" and "refused" in s["message"]
    assert took < budget(healthy, 1 * 2), f"took {took:.1f}s, healthy {healthy:.1f}s"  # connect_timeout x retries
    assert by(doc, "ssh", lab.host_name(1))[0]["status"] == "pass"


def test_link_down_times_out_within_connect_budget(lab, tmp_path):
    f = write(lab, tmp_path, ssh={"connect_timeout": 1, "retries": 2})
    _, healthy = orch_check(f, "--hosts", h(lab, 1, 2), "--json")
    lab.link(2, False)
    try:
        res, took = orch_check(f, "--hosts", h(lab, 1, 2), "--json")
    finally:
        lab.link(2, True)
    doc = results(res)
    (s,) = by(doc, "ssh", lab.host_name(2))
    assert s["status"] == "fail" and "timed out" in s["message"]
    assert took < budget(healthy, 1 * 2), f"took {took:.1f}s, healthy {healthy:.1f}s"
    (m,) = by(doc, "mesh", lab.host_name(1))
    assert m["status"] == "fail" and lab.host_name(2) in m["message"]


def test_stale_run_processes_warn_with_orch_down(lab, tmp_path):
    rid = f"chktest-{os.getpid()}"
    r = lab.ssh(2, f"ORCH_RUN_ID={rid} setsid sleep 60 >/dev/null 2>&1 </dev/null & echo $!")
    pid = int(r.stdout.split()[-1])
    try:
        res, _ = orch_check(write(lab, tmp_path), "--hosts", h(lab, 2), "--json")
    finally:
        lab.ssh(2, f"kill -9 {pid}")  # a host-local pid: each lab host has its own PID namespace
    doc = results(res)
    (w,) = [r for r in by(doc, "stale", lab.host_name(2)) if rid in r["message"]]
    assert w["status"] == "warn" and f"orch down --run {rid}" in w["message"] and str(pid) in w["message"]
    assert res.returncode == 0  # a warning does not fail the check


# --------------------------------------------------------------------------- reach: TCP to the launch host


def _listeners(lab, i: int) -> set[int]:
    """The pids of reach's listeners alive on host i (the lab enters the host's pid namespace). Those
    of earlier checks in this module whose hosts did not all come (h5 refuses the key) live on for
    their cap."""
    out = lab.exec(i, ["ps", "-eo", "pid=,args="]).stdout
    return {int(ln.split(None, 1)[0]) for ln in out.splitlines()
            if ln.split(None, 1)[1:] and ln.split(None, 1)[1].startswith("python3 -S -c import os,sys,socket,select")}


def _route(lab, i: int, action: str, *spec: str) -> None:
    lab.exec(i, ["ip", "route", action, *spec], check=action != "del")


def test_reach_names_the_host_that_cannot_reach_the_launch_host(lab, tmp_path):
    """ssh from here reaches every host, but h2 has no route to the launch host's address (a
    firewall, another network): reach fails h2 alone, naming the address it tried, how it failed
    and the fix; the other hosts pass; still one SSH connection per host; once every host came
    the launch host's listener is gone."""
    f = write(lab, tmp_path, launcher="ranktable")
    launch = lab.host(1).address
    h1, h2, h3 = (lab.host_name(i) for i in (1, 2, 3))
    older = _listeners(lab, 1)
    res, _ = orch_check(f, "--hosts", h(lab, 1, 2, 3), "--json")
    assert [x["status"] for x in by(results(res), "reach")] == ["pass"] * 3
    deadline = time.monotonic() + 5
    while _listeners(lab, 1) - older and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _listeners(lab, 1) - older, "the listener outlived the check although every host came"
    before = [_accepted(lab, i) for i in (1, 2, 3)]
    _route(lab, 2, "add", "unreachable", f"{launch}/32")
    try:
        res, took = orch_check(f, "--hosts", h(lab, 1, 2, 3), "--json")
    finally:
        _route(lab, 2, "del", "unreachable", f"{launch}/32")
    doc = results(res)
    assert res.returncode == 1 and doc["ok"] is False
    r = {x["host"]: x for x in by(doc, "reach")}
    assert r[h2]["status"] == "fail", r[h2]
    assert r[h2]["message"].startswith(f"cannot reach the launch host {h1} by TCP at {launch} (its cluster address): "
                                       "no route to host; ")
    assert f"`mpi_address: <an address of {h1} the hosts reach>` on {h1}" in r[h2]["message"]
    assert f"`job.interface: <{h1}'s NIC on the hosts' network>`" in r[h2]["message"]
    assert r[h3] == {"check": "reach", "host": h3, "status": "pass",
                     "message": f"reaches the launch host {h1} by TCP at {launch} (its cluster address)"}
    assert r[h1]["status"] == "pass"
    assert by(doc, "ssh", h2)[0]["status"] == "pass"  # ssh from here is not the question
    assert took < 15, f"a host that cannot reach the launch host cost {took:.1f}s"
    time.sleep(0.2)  # sshd logs asynchronously
    assert [_accepted(lab, i) - b for i, b in zip((1, 2, 3), before, strict=True)] == [1, 1, 1]


def test_reach_at_the_launch_hosts_other_address(lab, tmp_path):
    """The launch host has a second address and h2 reaches only that one: unpinned, reach warns
    (the run works) and says which address does; pinned to the first (job.interface), it fails and names the
    address that works as the fix."""
    f = write(lab, tmp_path, launcher="ranktable")
    launch = lab.host(1).address
    other = str(ipaddress.ip_network(lab.subnet).network_address + 200)
    h1, h2 = lab.host_name(1), lab.host_name(2)
    lab.exec(1, ["ip", "addr", "add", f"{other}/24", "dev", "eth0"], check=True)
    _route(lab, 2, "add", "blackhole", f"{launch}/32")
    try:
        res, _ = orch_check(f, "--hosts", h(lab, 1, 2), "--json")
        pinned, _ = orch_check(write(lab, tmp_path, launcher="ranktable", interface="eth0"), "--hosts",
                               h(lab, 1, 2), "--json")
    finally:
        _route(lab, 2, "del", "blackhole", f"{launch}/32")
        lab.exec(1, ["ip", "addr", "del", f"{other}/24", "dev", "eth0"])
    assert res.returncode == 0  # a warning: nothing failed
    (r,) = by(results(res), "reach", h2)
    assert r["status"] == "warn", r
    assert r["message"].startswith(f"reaches the launch host {h1} by TCP at {other}, not at {launch} (its cluster "
                                   "address: invalid argument)")
    (r,) = by(results(pinned), "reach", h2)
    assert r["status"] == "fail", r
    assert r["message"].startswith(f"cannot reach the launch host {h1} by TCP at {launch} (its address on "
                                   "job.interface): invalid argument; ")
    assert f"it does reach {h1} at {other}: set `mpi_address: {other}` on {h1}" in r["message"]


def test_reach_finds_the_dual_homed_launch_hosts_training_network(dual_homed_lab, tmp_path):
    """The launch host is on two networks (`orch lab up --dual-homed-head`): this machine reaches
    it on A, the other hosts only on B, and the inventory names it by its A address with no
    mpi_address. Reach: the others cannot reach A but find B, the address the run's supervisors
    and MASTER_ADDR will use, and a warning says so; with mpi_address pinning A, a fail whose fix
    is B."""
    lab = dual_homed_lab
    h1 = lab.host_name(1)
    a, b = lab.host(1).address, lab.peer_address(1)
    inv = yaml.safe_load(lab.inventory_path.read_text())
    assert inv["hosts"][0]["address"] == a and "mpi_address" not in inv["hosts"][0]
    # host 1 is the launch host only when its A address sorts first; the lab picks A and B as it
    # may, so the inventory orders the hosts by super_pod_id (which comes first when every host has one)
    for i, rec in enumerate(inv["hosts"]):
        rec["super_pod_id"] = 0 if i == 0 else 1
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    f = write(lab, tmp_path, launcher="ranktable")
    res, _ = orch_check(f, "-i", str(tmp_path / "inventory.yaml"), "--json")
    doc = results(res)
    assert res.returncode == 0 and doc["ok"] is True, res.stdout
    r = {x["host"]: x for x in by(doc, "reach")}
    assert r[h1]["status"] == "pass"
    for i in (2, 3):
        got = r[lab.host_name(i)]
        assert got["status"] == "warn", got
        assert got["message"].startswith(f"reaches the launch host {h1} by TCP at {b}, not at {a} (its cluster "
                                         "address: network is unreachable)"), got
        assert f"`mpi_address: {b}` on {h1} makes them all use it" in got["message"]
    inv["hosts"][0]["mpi_address"] = a
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    res, _ = orch_check(f, "-i", str(tmp_path / "inventory.yaml"), "--json")
    assert res.returncode == 1
    for got in by(results(res), "reach"):
        if got["host"] != h1:
            assert got["status"] == "fail"
            assert got["message"].startswith(f"cannot reach the launch host {h1} by TCP at {a} (its mpi_address): "
                                             f"network is unreachable; it does reach {h1} at {b}: set "
                                             f"`mpi_address: {b}` on {h1}"), got
