"""The run's supervisor against the training network and the other users of a host.

Each attack was reproduced on lab hosts against the old supervisor (one unauthenticated line
crashed the head and left its ranks running; idle connections were kept for ever; the lock was
anyone's to hold). Here each runs against a live detached run, as another uid on the launch host
and from a lab host outside the run: the run finishes as it would have, nothing of it is left
running, `orch status` is right, and the workdir's lock holds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import leftovers, orch, run_record, wait_until, write_fault_cluster

pytestmark = pytest.mark.lab

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
RANK = 'R=${OMPI_COMM_WORLD_RANK:-$RANK_ID}; '

ATTACK_PY = r'''
import socket, sys, time
addr, port, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
socks, refused = [], 0
def conn():
    global refused
    try:
        s = socket.create_connection((addr, port), timeout=3)
        socks.append(s)
        return s
    except OSError:
        refused += 1
if kind == "lines":
    for p in (b"[]\n", b"[" * 100000 + b"\n", b"{}\n", b"\xff\xfe\n", b'{"t":"report","token":"x"}\n',
              b'{"t":"hello","v":1,"role":"member","host":"HOST2","run":"RUN","nonce":"' + b"0" * 32 + b'"}\n'
              b'{"t":"auth","proof":"' + b"0" * 64 + b'"}\n'):
        s = conn()
        if s:
            try:
                s.sendall(p.replace(b"HOST2", sys.argv[4].encode()).replace(b"RUN", sys.argv[5].encode()))
            except OSError:
                pass
elif kind == "idle":
    for _ in range(200):
        conn()
elif kind == "big":
    for _ in range(150):
        s = conn()
        if s:
            try:
                s.sendall(b"y" * (1 << 20))
            except OSError:
                pass
time.sleep(6.5 if kind == "idle" else 2)   # idle: past the head's handshake deadline (5 s)
closed = 0
for s in socks:
    s.setblocking(False)
    try:
        while s.recv(65536):   # a challenge may come first: closed means the end was read
            pass
        closed += 1
    except BlockingIOError:
        pass
    except OSError:
        closed += 1
print("%d %d %d" % (len(socks), refused, closed))
'''


@pytest.fixture(scope="module")
def alab(fx_lab):
    return fx_lab("w", 3)


def _cluster(lab, tmp_path, workdir, command, **job) -> Path:
    return write_fault_cluster(lab, tmp_path, workdir=workdir, command=command, hosts=2,
                               defaults={"slots": 1}, checks={"versions": ["python"]}, **job)


def _status(cwd, rc=None) -> dict:
    return json.loads(orch("status", "--json", cwd=cwd, check_rc=rc).stdout)


def _head_state(lab, workdir, run_id) -> dict:
    return json.loads(lab.exec(1, ["cat", f"{workdir}/.orch/{run_id}/state.json"]).stdout)


def _rss_kib(lab, pid) -> int:
    for line in lab.exec(1, ["cat", f"/proc/{pid}/status"]).stdout.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _detached(lab, tmp_path, workdir, seconds=8):
    _cluster(lab, tmp_path, workdir, ["sh", "-c", RANK + f"echo up $R; sleep {seconds}; echo done $R"],
             launcher="ranktable")
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    port = run_record(tmp_path, run_id)["supervisor_port"]
    assert wait_until(lambda: _status(tmp_path)["state"] == "running", 30)
    return run_id, port


def _ends_as_it_would_have(lab, tmp_path, run_id, workdir):
    assert wait_until(lambda: _status(tmp_path)["state"] != "running", 60)
    st = _status(tmp_path, rc=0)
    assert st["state"] == "succeeded" and [r["exit_code"] for r in st["ranks"]] == [0, 0], st
    assert wait_until(lambda: leftovers(run_id) == [], 15), leftovers(run_id)
    assert orch("logs", "--rank", "1", cwd=tmp_path, check_rc=0).stdout == b"up 1\ndone 1\n"


@pytest.mark.parametrize("kind", ["lines", "idle", "big"])
@pytest.mark.parametrize("where", ["other-host", "other-uid"])
def test_garbage_idle_and_huge_connections_leave_the_run_as_it_was(alab, tmp_path, kind, where):
    """`[]`, 100k `[`, bytes that are not UTF-8, a hello with a forged proof (lines); 200 idle
    connections (idle); 150 connections of 1 MB without a newline (big): from a lab host outside
    the run, and from another uid on the launch host. Each connection is closed (the idle ones
    after the handshake deadline, at most 64 kept at once), the head's memory stays bounded, and
    the run succeeds as it would have."""
    workdir = f"/data/atk-{kind}-{where}"
    run_id, port = _detached(alab, tmp_path, workdir, seconds=12)
    head_pid = _head_state(alab, workdir, run_id)["agent_pid"]
    rss0 = _rss_kib(alab, head_pid)
    args = ["python3", "-I", "-c", ATTACK_PY]
    if where == "other-host":
        res = alab.exec(3, [*args, alab.host(1).address, str(port), kind, alab.host(2).name, run_id], timeout=60)
    else:
        res = alab.exec(1, [*NOBODY, *args, "127.0.0.1", str(port), kind, alab.host(2).name, run_id], timeout=60)
    opened, refused, closed = map(int, res.stdout.split())
    rss1 = _rss_kib(alab, head_pid)
    print(f"\n{kind} from {where}: {opened} connections opened ({refused} refused), {closed} closed by the head "
          f"by the head; its RSS {rss0} -> {rss1} KiB")
    assert opened + refused > 0
    assert closed == opened, res.stdout
    assert 0 < rss1 and rss1 - rss0 < 32 * 1024
    _ends_as_it_would_have(alab, tmp_path, run_id, workdir)
    log = alab.exec(1, ["cat", f"{workdir}/.orch/{run_id}/agent.log"]).stdout
    assert "closed the connection from" in log


def test_another_user_can_neither_read_the_run_nor_hold_its_lock(alab, tmp_path):
    """What orch writes on a host is the run's user's alone: another uid cannot enter .orch/, read
    the token (agent.json) or the state, or open the workdir's lock to hold it; the next `orch up`
    in that workdir is not blocked by anything that uid did."""
    workdir = "/data/atk-files"
    run_id, _ = _detached(alab, tmp_path, workdir, seconds=2)
    for path in (f"{workdir}/.orch/lock", f"{workdir}/.orch/{run_id}/agent.json",
                 f"{workdir}/.orch/{run_id}/state.json", f"{workdir}/.orch/{run_id}/a1/1/rank.0/stdout"):
        res = alab.exec(1, [*NOBODY, "python3", "-I", "-c", "import sys; open(sys.argv[1]).read()", path])
        assert res.returncode != 0 and "PermissionError" in res.stderr, (path, res.stderr)
    modes = alab.exec(1, ["stat", "-c", "%a %n", f"{workdir}/.orch", f"{workdir}/.orch/lock",
                          f"{workdir}/.orch/{run_id}"]).stdout.split("\n")
    assert [m.split()[0] for m in modes if m] == ["700", "600", "700"], modes
    _ends_as_it_would_have(alab, tmp_path, run_id, workdir)
    orch("up", "-q", cwd=tmp_path, check_rc=0)   # the lock holds for us


def test_the_head_listens_on_its_addresses_not_everywhere(alab, tmp_path):
    workdir = "/data/atk-listen"
    run_id, port = _detached(alab, tmp_path, workdir, seconds=3)
    lines = alab.exec(1, ["ss", "-Hltn", f"sport = :{port}"]).stdout.split("\n")
    local = sorted(line.split()[3].rsplit(":", 1)[0] for line in lines if line.strip())
    assert local and "0.0.0.0" not in local and "*" not in local, local
    assert alab.host(1).address in local and "127.0.0.1" in local
    _ends_as_it_would_have(alab, tmp_path, run_id, workdir)


def test_a_head_killed_by_sigkill_leaves_nothing_running_and_status_says_lost(alab, tmp_path):
    """kill -9 of the head's supervisor: its own ranks die with it (they used to run on in their
    own sessions while status said `stopped`), the members stop theirs at once (their link to the
    head closed), `orch status` says lost, and the next `orch up` there runs. The time from the
    kill to the last process of the run gone on every host is printed."""
    workdir = "/data/atk-crash"
    _cluster(alab, tmp_path, workdir, ["sh", "-c", RANK + "echo up $R; exec sleep 300"], launcher="ranktable")
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(run_id, "sleep")) == 2, 30)
    head_pid = _head_state(alab, workdir, run_id)["agent_pid"]
    t0 = time.monotonic()
    alab.exec(1, ["kill", "-9", str(head_pid)], check=True)
    assert wait_until(lambda: leftovers(run_id) == [], 30), leftovers(run_id)
    took = time.monotonic() - t0
    print(f"\nhead SIGKILLed: every process of the run gone on every host {took:.2f} s later")
    st = _status(tmp_path, rc=1)
    assert st["state"] == "lost" and "is gone" in st["message"], st
    assert all(r["state"] in ("stopped", "lost") for r in st["ranks"]), st["ranks"]
    _cluster(alab, tmp_path, workdir, ["sh", "-c", "echo again"], launcher="ranktable")
    orch("up", "-q", cwd=tmp_path, check_rc=0)


def test_a_workdir_where_an_earlier_runs_process_lives_is_refused(alab, tmp_path):
    """A process of an earlier run still alive (its supervisor killed; the process escaped into a
    session of its own): `orch up` there refuses (exit 2) naming that run and `orch down --run`;
    after `orch down --run` it runs."""
    workdir = "/data/atk-orphan"
    _cluster(alab, tmp_path, workdir, ["sh", "-c", "setsid sleep 300 < /dev/null > /dev/null 2>&1 & exec sleep 300"],
             launcher="ranktable")
    old = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(old, "sleep")) == 4, 30)
    pids = {i: json.loads(alab.exec(i, ["cat", f"{workdir}/.orch/{old}/state.json"]).stdout)["agent_pid"]
            for i in (1, 2)}
    for sig in ("STOP", "KILL"):   # both at once: neither hears the other go and cleans up
        for i, pid in pids.items():
            alab.exec(i, ["kill", f"-{sig}", str(pid)], check=True)
    assert wait_until(lambda: len(leftovers(old, "sleep")) == 2, 15)   # the escaped ones live on
    res = orch("up", "-q", cwd=tmp_path, check_rc=2)
    err = res.stderr.decode()
    assert old in err and f"orch down --run {old}" in err, err
    orch("down", "--run", old, cwd=tmp_path)
    assert wait_until(lambda: leftovers(old) == [], 15)
    _cluster(alab, tmp_path, workdir, ["sh", "-c", "echo again"], launcher="ranktable")
    orch("up", "-q", cwd=tmp_path, check_rc=0)


def test_mpirun_never_carries_a_secret(alab, tmp_path):
    """With mpirun, a secret's value reaches every rank from its host's supervisor and is never
    in mpirun's own environment or argv (whatever mpirun has, Open MPI sends to every host's
    daemon in clear)."""
    workdir = "/data/atk-secret"
    _cluster(alab, tmp_path, workdir, ["sh", "-c", RANK + 'echo "$R:$HF_TOKEN"; sleep 4'], launcher="mpirun",
             env={"HF_TOKEN": "s3cr3t-value"})
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(run_id, "sleep")) == 2, 30)
    seen = []
    for pid in leftovers(run_id):
        for part in ("environ", "cmdline"):
            try:
                data = Path(f"/proc/{pid}/{part}").read_bytes()
            except OSError:
                continue
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if b"s3cr3t-value" in data:
                seen.append(name)
    assert "mpirun" not in seen and "orted" not in seen and "prted" not in seen, seen
    assert wait_until(lambda: _status(tmp_path)["state"] == "succeeded", 60)
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    assert "0:s3cr3t-value" in out and "1:s3cr3t-value" in out, out
    assert alab.exec(1, ["ls", f"{workdir}/.orch/{run_id}/secrets.json"]).returncode != 0   # removed at the end
