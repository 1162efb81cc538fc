"""orch up / status / down / logs on the lab: launch, follow, fail fast, stop, gather."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.supervisor import STOP_GRACE
from tests.support import (REPO, budget, leftovers, orch, run_ids, run_record, spawn_orch, timed, wait_until,
                           write_cluster)

pytestmark = pytest.mark.lab

RANK_PY = """\
import os, socket, sys, time
r = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK_ID")
print(f"rank {r} on {socket.gethostname()}", flush=True)
time.sleep(float(os.environ.get("SLEEP", "0")))
if os.environ.get("FAIL_RANK") == r:
    print("failing on purpose", flush=True)
    sys.exit(3)
"""


@pytest.fixture
def job(lab, tmp_path):
    (tmp_path / "rank.py").write_text(RANK_PY)

    def make(workdir: str, **kw) -> Path:
        kw.setdefault("command", "python3 rank.py")
        kw.setdefault("sync", ["rank.py"])
        return write_cluster(lab, tmp_path, workdir=workdir, **kw)

    return make


def test_mpirun_2x2_succeeds_and_gathers_every_rank(lab, job, tmp_path):
    job("/data/up-mpi", hosts=2)
    res = orch("up", cwd=tmp_path, check_rc=0)
    rec = run_record(tmp_path)
    assert rec["state"] == "succeeded" and rec["exit_codes"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    names = [lab.host(1).name, lab.host(1).name, lab.host(2).name, lab.host(2).name]
    for r in range(4):
        log = tmp_path / ".orch" / "runs" / rec["id"] / "logs" / f"rank.{r}" / "stdout"
        assert log.read_text() == f"rank {r} on {names[r]}\n"
    assert b"rank 0 on" in res.stdout  # rank 0 is followed live by default
    assert b"\x1b" not in res.stdout + res.stderr   # a pipe: plain lines, no live view
    assert orch("logs", "--rank", "3", cwd=tmp_path, check_rc=0).stdout == f"rank 3 on {names[3]}\n".encode()
    every = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode().splitlines()
    assert every == [f"[rank {r}] rank {r} on {names[r]}" for r in range(4)]
    assert (tmp_path / ".orch" / "runs" / rec["id"] / "hostfile").read_text().count("slots=2") == 2
    assert leftovers(rec["id"]) == []


@pytest.mark.parametrize("planted", [False, True], ids=["shared", "planted"])
def test_the_launch_host_logs_in_to_each_host_once_sharing_its_mesh_tests_connection(lab, job, tmp_path, planted):
    """`orch up` of an mpirun job: the sync relay's ssh and mpirun's own share the connection the
    launch host's mesh test opened to each other host: each accepts one login from it, not three.
    A directory for those sockets that another user made (here: nobody's, mode 777) is not used:
    the run succeeds all the same, with a login each."""
    job("/data/up-share", hosts=3, sync=["rank.py"])
    (tmp_path / "rank.py").write_text(RANK_PY + "# changed: the relay passes it on\n")
    head = lab.host(1)
    share_dir = lab.host_dir(1) / "tmp" / "orch-ssh-0"
    aside = share_dir.with_name("orch-ssh-0.aside")
    if planted:
        if share_dir.exists():
            share_dir.rename(aside)
        share_dir.mkdir()
        share_dir.chmod(0o777)
        os.chown(share_dir, 65534, 65534)
    logins = [lab.sshd_log(i).read_text(errors="replace").count(f"Accepted publickey for root from {head.address} ")
              for i in (2, 3)]
    try:
        orch("up", cwd=tmp_path, check_rc=0)
    finally:
        if planted:
            share_dir.rmdir()
            if aside.exists():
                aside.rename(share_dir)
    rec = run_record(tmp_path)
    assert rec["state"] == "succeeded"
    after = [lab.sshd_log(i).read_text(errors="replace").count(f"Accepted publickey for root from {head.address} ")
             for i in (2, 3)]
    # planted: the mesh test, the relay and mpirun each log in (no master to share)
    assert [a - b for a, b in zip(after, logins)] == ([3, 3] if planted else [1, 1])
    mpirun = json.dumps(rec["commands"])
    assert ("ControlPath=/tmp/orch-ssh-0/" in mpirun) is not planted


def _sessions(lab, i: int) -> int:
    """Commands (SSH sessions) host i ran so far for this machine (its sshd log: LogLevel VERBOSE;
    this machine's address on the lab's bridge, x.y.z.1: not the launch host's, mpirun's own)."""
    me = lab.host(i).address.rsplit(".", 1)[0] + ".1"
    return sum("Starting session: " in ln and f" from {me} port " in ln
               for ln in lab.sshd_log(i).read_text(errors="replace").splitlines())


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_each_members_supervisor_starts_in_its_checks_session(lab, job, tmp_path, launcher):
    """`orch up` (nothing to sync): a member host runs two commands, its check (whose python3
    then becomes the run's supervisor, checks/reach.py HOLD_PY) and the gather; the launch host
    starts its head in a session of its own. Nothing is left holding a session afterwards."""
    extra = {"launcher": "ranktable", "platform": "ascend", "defaults": {"slots": 8},
             "checks": {"versions": ["python"]}} if launcher == "ranktable" else {}
    job(f"/data/up-held-{launcher}", hosts=3, **extra)
    orch("up", cwd=tmp_path, check_rc=0)   # the first: syncs
    before = [_sessions(lab, i) for i in (2, 3)]
    orch("up", cwd=tmp_path, check_rc=0)
    rec = run_record(tmp_path)
    assert rec["state"] == "succeeded"
    assert [_sessions(lab, i) - b for i, b in zip((2, 3), before)] == [2, 2]
    assert leftovers(rec["id"]) == []
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _holds(p)], "a held session's process is left"


def _holds(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return False
    return any(e.startswith(b"ORCH_HOLD=") for e in env)


def test_a_failed_check_leaves_no_process_holding_a_session(lab, job, tmp_path):
    """The members' checks hold their sessions for the start; the preflight fails (a file to
    sync is missing): nothing starts, and what held the sessions is gone with them."""
    job("/data/up-held-fail", hosts=3, sync=["rank.py", "missing.py"])
    res = orch("up", cwd=tmp_path)
    assert res.returncode != 0 and b"missing.py" in res.stdout + res.stderr
    deadline = time.monotonic() + 10
    while [p for p in os.listdir("/proc") if p.isdigit() and _holds(p)]:
        assert time.monotonic() < deadline, "a held session's process outlived `orch up`"
        time.sleep(0.1)


LIVE_PY = """\
import os, time
r = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK_ID"))
for s in range(1, 13):
    print(f"epoch: 1, step: {s}, loss is {1 / s:.4f}", flush=True)
    print(f"line {s:03d} of rank {r} " + "x" * 40, flush=True)
    if s == 4 and r == 0:   # an unfinished line while the view is redrawn (each second)
        print("part-a", end="", flush=True)
        time.sleep(2.5)
        print("-part-b", flush=True)
    time.sleep(0.4)
"""


def _under_a_terminal(argv: list[str], cwd: Path, rows: int, columns: int, timeout: float) -> tuple[int, bytes]:
    """Run argv with stdin, stdout and stderr on a new pseudo-terminal of rows x columns:
    (its exit code, every byte it wrote there)."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import time

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, stdin=secondary, stdout=secondary, stderr=secondary,
                            env={**os.environ, "TERM": "xterm"}, start_new_session=True)
    os.close(secondary)
    raw, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([primary], [], [], 1.0)[0]:
                try:
                    data = os.read(primary, 65536)
                except OSError:   # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                raw += data
        return proc.wait(10), raw
    finally:
        proc.kill()
        os.close(primary)


def test_attached_up_on_a_terminal_keeps_the_live_table_under_the_ranks_intact_output(lab, job, tmp_path):
    import re

    import pyte

    from tests.support import ORCH

    (tmp_path / "live.py").write_text(LIVE_PY)
    job("/data/up-live", hosts=2, command="python3 live.py", sync=["live.py"])
    rows, columns = 40, 150
    rc, raw = _under_a_terminal([*ORCH, "up", "--skip-checks"], tmp_path, rows, columns, 180)
    screen = pyte.HistoryScreen(columns, rows, history=2000)
    pyte.ByteStream(screen).feed(raw)
    seen = ["".join(line[x].data for x in range(columns)).rstrip() for line in screen.history.top]
    seen += [ln.rstrip() for ln in screen.display]   # what a user scrolls back through, then sees
    assert rc == 0, seen
    mine = [ln for ln in seen if re.match(r"(epoch: |line \d|part-)", ln)]
    want = []
    for s in range(1, 13):
        want += [f"epoch: 1, step: {s}, loss is {1 / s:.4f}", f"line {s:03d} of rank 0 " + "x" * 40]
        want += ["part-a-part-b"] if s == 4 else []
    assert mine == want, seen   # rank 0's lines whole, in order, nothing of the view among them
    assert raw.count(b"\x1b7") >= 5, raw[-2000:]   # the view was drawn again and again meanwhile
    midway = pyte.Screen(columns, rows)   # the screen while rank 0's line is unfinished: the view under it
    pyte.ByteStream(midway).feed(raw[:raw.rindex(b"\x1b8", 0, raw.index(b"-part-b"))])
    shown = [ln.rstrip() for ln in midway.display]
    at = shown.index("part-a")
    assert shown[at + 1].startswith("orch: ") and shown[at + 2].startswith("run "), shown
    names = [lab.host(1).name, lab.host(1).name, lab.host(2).name, lab.host(2).name]
    end = seen[seen.index(want[-1]) + 1:]    # its last state stays under the output, then the verdict
    assert end[0] == "orch: 0 running, 4/4 ranks exited, " + end[0].rsplit(" ", 1)[-1], end
    assert re.match(r"run \S+: succeeded, 4 ranks$", end[1]), end
    for r in range(4):
        assert re.match(rf"rank {r} {names[r]} +exited +step 12 +loss 0.0833 ", end[2 + r]), end
    assert re.match(r"orch: run \S+ succeeded", end[6]), end


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_failing_rank_stops_everything_and_is_named(lab, job, tmp_path, launcher):
    job(f"/data/up-fail-{launcher}", launcher=launcher, env={"SLEEP": "0.5"}, hosts=2)
    _, healthy = timed(orch, "up", "-q", cwd=tmp_path, check_rc=0)
    job(f"/data/up-fail-{launcher}", launcher=launcher, env={"FAIL_RANK": "3", "SLEEP": "0.5"}, hosts=2)
    if launcher == "ranktable":  # rank 3 fails at once, the others would run for a minute
        job(f"/data/up-fail-{launcher}", launcher=launcher, hosts=2,
            command=["sh", "-c", 'if [ "$RANK_ID" = 3 ]; then echo failing; exit 3; fi; echo $RANK_ID; sleep 60'])
    res, took = timed(orch, "up", "-q", cwd=tmp_path, check_rc=1)
    assert took < budget(healthy, STOP_GRACE), f"{took:.1f}s, healthy {healthy:.1f}s"  # TERM, KILL after the grace
    err = res.stderr.decode()
    assert f"rank 3 on {lab.host(2).name}" in err and "exit code 3" in err and "failing" in err
    rec = run_record(tmp_path)
    assert rec["state"] == "failed" and rec["first_failure"]["rank"] == 3
    assert rec["first_failure"]["exit_code"] == 3
    logs = tmp_path / ".orch" / "runs" / rec["id"] / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank.0", "rank.1", "rank.2", "rank.3"]
    assert leftovers(rec["id"]) == []


def test_ranktable_ascend_2x8_each_rank_matches_table_and_hccn(lab, tmp_path):
    script = (REPO / "playbooks" / "ascend" / "check_env.py").read_text()
    (tmp_path / "check_env.py").write_text(script)
    write_cluster(lab, tmp_path, workdir="/data/up-ascend", launcher="ranktable", platform="ascend",
                  command="python3 check_env.py", sync=["check_env.py"], defaults={"slots": 8}, hosts=2,
                  checks={"versions": ["python"]})  # no MindSpore/CANN on the lab: the contract is tested
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    rec = run_record(tmp_path)
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    assert out.count("env ok") == 16, out
    table = json.loads((tmp_path / ".orch" / "runs" / rec["id"] / "rank_table.json").read_text())
    assert [s["server_id"] for s in table["server_list"]] == [lab.host(1).address, lab.host(2).address]
    env3 = lab.exec(1, ["cat", "/data/up-ascend/log_output/1/rank.3/env.log"]).stdout
    assert "DEVICE_ID=3" in env3 and "RANK_ID=3" in env3


def test_ranktable_partial_devices_4_to_7_legacy_table(lab, tmp_path):
    (tmp_path / "check_env.py").write_text((REPO / "playbooks" / "ascend" / "check_env.py").read_text())
    write_cluster(lab, tmp_path, workdir="/data/up-partial", launcher="ranktable", platform="ascend",
                  command="python3 check_env.py", sync=["check_env.py"], rank_table={"version": "legacy"},
                  defaults={"slots": 4, "devices": [4, 5, 6, 7]}, hosts=1, checks={"versions": ["python"]})
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    assert [ln.split()[7] for ln in out.splitlines()] == ["4", "5", "6", "7"], out


@pytest.mark.parametrize("sig,by", [(signal.SIGINT, "Ctrl-C in `orch up`"), (signal.SIGTERM, "a SIGTERM to `orch up`")])
def test_sigint_or_sigterm_stops_every_rank_and_exits_130_saying_which(lab, job, tmp_path, sig, by):
    job("/data/up-sigint", launcher="ranktable", command=["sh", "-c", "echo up; sleep 120"])
    proc = spawn_orch("up", "-q", cwd=tmp_path)
    try:
        # run_ids: a run whose directory is made but whose record is not written yet has none
        assert wait_until(lambda: run_ids(tmp_path) and run_record(tmp_path).get("state") == "running", 60)
        run_id = run_record(tmp_path)["id"]
        assert wait_until(lambda: len(leftovers(run_id)) >= 6, 30)
        proc.send_signal(sig)
        rc = proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert rc == 130, err
    assert f"interrupted: stopped by {by}: every rank was stopped" in err, err
    rec = run_record(tmp_path)
    assert rec["state"] == "interrupted" and rec["ended"] is not None
    st = json.loads(orch("status", "--json", cwd=tmp_path).stdout)
    assert st["message"] == f"stopped by {by}", st["message"]
    assert {r["state"] for r in st["ranks"]} == {"stopped"}, st["ranks"]
    assert leftovers(run_id) == []
    assert orch("logs", "--rank", "5", cwd=tmp_path, check_rc=0).stdout == b"up\n"


def test_detach_status_down_and_logs_follow(lab, job, tmp_path):
    job("/data/up-detach", launcher="ranktable", command=["sh", "-c", "echo start; sleep 120; echo never"])
    res = orch("up", "--detach", cwd=tmp_path, check_rc=0)
    run_id = res.stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(run_id)) >= 6, 30)
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert st["run"] == run_id and [r["state"] for r in st["ranks"]] == ["running"] * 6
    assert all(r["pid"] for r in st["ranks"])
    # an unrelated process with the very same command line must survive `orch down`
    bystander = subprocess.Popen(["sh", "-c", "echo start; sleep 120; echo never"], stdout=subprocess.DEVNULL)
    try:
        orch("down", cwd=tmp_path, check_rc=0)
        assert leftovers(run_id) == []
        assert bystander.poll() is None, "orch down killed a process that was not part of the run"
    finally:
        bystander.kill()
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=4).stdout)  # 4: stopped
    assert st["state"] == "stopped" and {r["state"] for r in st["ranks"]} == {"stopped"}
    assert orch("logs", "--rank", "2", cwd=tmp_path, check_rc=0).stdout == b"start\n"
    orch("down", cwd=tmp_path, check_rc=0)  # idempotent


def test_logs_follow_streams_until_ranks_end(lab, job, tmp_path):
    job("/data/up-follow", launcher="ranktable", hosts=1,
        command=["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.5; done"])
    run_id = orch("up", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    res = orch("logs", "-f", "--rank", "1", "--run", run_id, cwd=tmp_path, timeout=60, check_rc=0)
    assert res.stdout == b"line 1\nline 2\nline 3\n"


def test_job_timeout_stops_everything(lab, job, tmp_path):
    job("/data/up-timeout", launcher="ranktable", timeout=2, command=["true"])
    _, healthy = timed(orch, "up", "-q", cwd=tmp_path, check_rc=0)
    job("/data/up-timeout", launcher="ranktable", timeout=2, command=["sleep", "60"])
    res, took = timed(orch, "up", "-q", cwd=tmp_path, check_rc=1)
    assert took < budget(healthy, 2 + STOP_GRACE), f"{took:.1f}s, healthy {healthy:.1f}s"
    assert "timed out" in res.stderr.decode() or "timeout" in res.stderr.decode()
    rec = run_record(tmp_path)
    assert rec["state"] == "timeout" and leftovers(rec["id"]) == []


def test_preflight_failure_starts_nothing(lab, job, tmp_path):
    job("/data/up-preflight", command="python3 rank.py", sync=["rank.py", "missing.py"])
    res = orch("up", cwd=tmp_path)
    assert res.returncode in (2, 3), res.stderr.decode()
    assert not (tmp_path / ".orch" / "runs").exists() or not any((tmp_path / ".orch" / "runs").iterdir())


def test_local_demo_main_job(tmp_path):
    res = orch("up", str(REPO / "playbooks" / "local-demo.yaml"), cwd=tmp_path, check_rc=0)
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    sums = {ln.rsplit(" ", 1)[1] for ln in out.splitlines() if "weights checksum" in ln}
    assert len(sums) == 1, out
    losses = [float(ln.rsplit(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("[rank 0] epoch")]
    assert losses[-1] < losses[0]
    assert b"epoch: 1, step: 1, loss is" in res.stdout


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_rank_dirs_give_each_rank_its_own_directory(lab, tmp_path, launcher):
    """job.rank_dirs: each rank starts in workdir/rank_<N> (as the reference scripts' device_$i/),
    finds the synced files there, and what it writes at a fixed relative path stays its own."""
    (tmp_path / "rd.py").write_text(
        "import os\n"
        "r = os.environ.get('OMPI_COMM_WORLD_RANK') or os.environ.get('RANK_ID')\n"
        "open('ckpt.txt', 'w').write(r)\n"
        "print(os.getcwd(), open('ckpt.txt').read(), flush=True)\n")
    workdir = f"/data/up-rankdirs-{launcher}"
    write_cluster(lab, tmp_path, workdir=workdir, hosts=2, launcher=launcher, command="python3 rd.py",
                  sync=["rd.py"], rank_dirs=True)
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    for r in range(4):
        out = orch("logs", "--rank", str(r), cwd=tmp_path, check_rc=0).stdout.decode()
        assert out == f"{workdir}/rank_{r} {r}\n", out
        host = 1 + r // 2
        assert lab.exec(host, ["cat", f"{workdir}/rank_{r}/ckpt.txt"]).stdout == str(r)
    assert lab.exec(1, ["sh", "-c", f"test -e {workdir}/ckpt.txt || echo absent"]).stdout == "absent\n"


def test_logs_into_a_closed_pipe_end_quietly(tmp_path):
    """`orch logs --rank 0 | head -1`: the reader leaves early; orch ends with 141 (SIGPIPE's
    status, as `cat` would) and says nothing: no "internal error", no crash file."""
    import glob
    import tempfile

    (tmp_path / "cluster.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 1}]}\n"
        f"job: {{workdir: {tmp_path}/wd, launcher: ranktable, command: [sh, -c, 'yes 0123456789abcdef | head -n 100000']}}\n")
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    crashes = set(glob.glob(f"{tempfile.gettempdir()}/orch-crash-*"))
    proc = spawn_orch("logs", "--rank", "0", cwd=tmp_path)
    assert proc.stdout.readline() == b"0123456789abcdef\n"
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == "", err
    assert set(glob.glob(f"{tempfile.gettempdir()}/orch-crash-*")) == crashes


def test_logs_hosts_pattern_and_the_old_host_flag(lab, tmp_path):
    """`orch logs --hosts PATTERN` (the flag every other command has); `--host` still works."""
    h1, h2 = lab.host(1).name, lab.host(2).name
    write_cluster(lab, tmp_path, workdir="/data/up-logs-hosts", hosts=2, launcher="ranktable",
                  inventory={"groups": {"second": [h2]}}, command=["sh", "-c", "echo r$RANK_ID"])
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    assert orch("logs", "--hosts", "second", cwd=tmp_path, check_rc=0).stdout == b"[rank 2] r2\n[rank 3] r3\n"
    assert orch("logs", "--hosts", h2, cwd=tmp_path, check_rc=0).stdout == b"[rank 2] r2\n[rank 3] r3\n"
    assert orch("logs", "--hosts", f"{h1},{h2}", "--rank", "1", cwd=tmp_path, check_rc=0).stdout == b"r1\n"
    assert orch("logs", "--host", h1, cwd=tmp_path, check_rc=0).stdout == b"[rank 0] r0\n[rank 1] r1\n"
    assert b"no host or group named nosuch9" in orch("logs", "--hosts", "nosuch9", cwd=tmp_path, check_rc=2).stderr
