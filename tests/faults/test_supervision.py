"""Runs supervise themselves on the cluster (orchestrator/supervisor/agent.py).

Each test states the promise it holds orch to. Every lifecycle that once went wrong one
time in three is run many times here, not once.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.supervisor import STOP_GRACE
from tests.support import (budget, host_procs, kill_run_on, leftovers, orch, run_ids, run_record, running, spawn_orch,
                           sshd_lines, timed, up_then_kill_controller, wait_until, write_fault_cluster)

pytestmark = pytest.mark.lab

RANK = 'R=${OMPI_COMM_WORLD_RANK:-$RANK_ID}; '


@pytest.fixture(scope="module")
def sup(fx_lab):
    return fx_lab("v", 4)  # letters name labs: "s" is the key-refusing one of test_ssh_security


def _defaults(lab, **kw) -> dict:
    return {"defaults": {**yaml.safe_load(Path(lab.inventory_path).read_text())["defaults"], **kw}}


def _cluster(lab, tmp_path, workdir, command, *, slots=1, hosts=None, name="cluster.yaml", **job) -> Path:
    return write_fault_cluster(lab, tmp_path, name=name, workdir=workdir, command=command, hosts=hosts,
                               inventory=_defaults(lab, slots=slots), checks={"versions": ["python"]}, **job)


def _status(cwd, *args, rc=None) -> dict:
    return json.loads(orch("status", "--json", *args, cwd=cwd, check_rc=rc).stdout)


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_twenty_runs_in_a_row_each_reported_as_it_ended(sup, tmp_path, launcher):
    """A run is reported as it ended, every time: 20 consecutive `orch up` of a job whose
    ranks all exit 0 on 4 hosts exit 0 and `orch status` says succeeded with every exit code 0;
    20 more with one failing rank exit 1 naming that rank, host and exit code. (Reporting
    success as failure one time in three went unnoticed while each test ran once.)"""
    ok = ["sh", "-c", RANK + "echo hello $R"]
    bad = ["sh", "-c", RANK + 'echo hello $R; [ "$R" = 2 ] && { echo failing; exit 3; }; exit 0']
    for command, want_rc in ((ok, 0), (bad, 1)):
        _cluster(sup, tmp_path, f"/data/sv-loop-{launcher}", command, launcher=launcher)
        for i in range(20):
            res = orch("up", "-q", "--skip-checks", cwd=tmp_path)
            err = res.stderr.decode()
            assert res.returncode == want_rc, (i, err)
            st = _status(tmp_path, rc=want_rc)
            codes = [r["exit_code"] for r in st["ranks"]]
            if want_rc == 0:
                assert st["state"] == "succeeded" and codes == [0, 0, 0, 0], (i, st)
            else:
                assert f"rank 2 on {sup.host(3).name}" in err and "exit code 3" in err, (i, err)
                assert st["state"] == "failed" and st["first_failure"]["rank"] == 2, (i, st)
                assert st["first_failure"]["exit_code"] == 3
    assert all(leftovers(r) == [] for r in run_ids(tmp_path))


def test_detached_run_that_succeeds_is_recorded_by_the_cluster(sup, tmp_path):
    """`orch up --detach` of a job that finishes: `orch status` (read from the cluster) says
    succeeded with every exit code, exit 0, and nothing of the run is left on any host."""
    _cluster(sup, tmp_path, "/data/sv-detach-ok", ["sh", "-c", RANK + "echo hi $R; sleep 1"], launcher="ranktable")
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: _status(tmp_path)["state"] == "succeeded", 30)
    st = _status(tmp_path, rc=0)
    assert [r["exit_code"] for r in st["ranks"]] == [0, 0, 0, 0] and st["run"] == run_id
    assert wait_until(lambda: leftovers(run_id) == [], 10)
    assert orch("logs", "--rank", "3", cwd=tmp_path, check_rc=0).stdout == b"hi 3\n"


def test_detached_failing_rank_stops_every_other_rank_within_seconds(sup, tmp_path):
    """No controller attached, `job.on_failure: stop` still holds: a rank that fails stops
    every other rank on every host within 10 s (TERM, then KILL after 5 s), and `orch status`
    says failed, naming the rank, its host and its exit code (exit 1)."""
    def detached(cmd: list[str]) -> tuple[str, float]:
        """Start `cmd` detached; return the run id and the seconds from rank 2's end (it writes
        /data/sv-ff/failed_at, then ends) until the last process of the run is gone."""
        sup.exec(3, ["rm", "-f", "/data/sv-ff/failed_at"])
        _cluster(sup, tmp_path, "/data/sv-ff", cmd, launcher="ranktable")
        run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
        assert wait_until(lambda: sup.exec(3, ["cat", "/data/sv-ff/failed_at"]).stdout.strip() != "", 30)
        failed_at = float(sup.exec(3, ["cat", "/data/sv-ff/failed_at"]).stdout)
        assert wait_until(lambda: leftovers(run_id) == [], 60)  # the others sleep 120 s
        return run_id, time.time() - failed_at

    ends = RANK + 'echo up $R; if [ "$R" = 2 ]; then sleep 2; date +%s.%N > /data/sv-ff/failed_at; '
    _, healthy = detached(["sh", "-c", ends + "fi"])  # every rank ends by itself: the supervisor's own exit
    run_id, took = detached(["sh", "-c", ends + "exit 3; fi; exec sleep 120"])
    print(f"detached fail-fast: last process of the run gone {took:.1f}s after the failure (healthy {healthy:.1f}s)")
    assert took < budget(healthy, STOP_GRACE)  # TERM, then KILL after the grace
    st = _status(tmp_path, rc=1)
    ff = st["first_failure"]
    assert st["state"] == "failed" and (ff["rank"], ff["host"], ff["exit_code"]) == (2, sup.host(3).name, 3), st
    assert {r["state"] for r in st["ranks"] if r["rank"] != 2} == {"stopped"}


def test_controller_killed_then_a_rank_fails_the_rest_are_still_stopped(sup, tmp_path):
    """The controller SIGKILLed mid-job (laptop closed): when a rank fails afterwards, the run's
    supervisor still stops the rest and records it; `orch status` from a fresh shell names it."""
    cmd = ["sh", "-c", RANK + 'echo up $R; if [ "$R" = 1 ]; then sleep 4; exit 5; fi; exec sleep 120']
    _cluster(sup, tmp_path, "/data/sv-ctlkill", cmd, launcher="ranktable")
    run_id = up_then_kill_controller(tmp_path, procs=4, args=("-q",), timeout=30)
    assert wait_until(lambda: leftovers(run_id) == [], 30), "the failure was not acted on without a controller"
    st = _status(tmp_path, rc=1)
    assert st["state"] == "failed" and st["first_failure"]["rank"] == 1 and st["first_failure"]["exit_code"] == 5


def test_link_cut_without_controller_is_a_lost_run_and_the_rest_stop(sup, tmp_path):
    """A host's link cut mid-job with no controller attached: the run is `lost` (the host
    named), every other host's ranks are stopped by the supervisor, and the cut-off host's
    supervisor, which lost the launch host, stops its own ranks too: nothing is left anywhere."""
    _cluster(sup, tmp_path, "/data/sv-cut", ["sh", "-c", RANK + "echo up $R; exec sleep 120"], launcher="ranktable",
             ssh={"connect_timeout": 2, "retries": 1})
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    # every rank runs (every host joined: the supervisors alone are 4 processes, and a host cut
    # off before it joins is another story, the head's join timeout)
    assert wait_until(lambda: len(leftovers(run_id, "sleep")) == 4, 20)
    sup.link(4, False)
    try:
        assert wait_until(lambda: host_procs(sup, 1, run_id) == [] and host_procs(sup, 2, run_id) == []
                          and host_procs(sup, 3, run_id) == [], 40)
        assert wait_until(lambda: host_procs(sup, 4, run_id) == [], 30)
    finally:
        sup.link(4, True)
    st = _status(tmp_path, rc=1)
    assert st["state"] == "lost" and st["lost"] == [sup.host(4).name], st
    assert f"lost contact with host {sup.host(4).name} (rank 3)" in st["message"]


def test_lost_hosts_are_described_by_what_was_seen(sup, tmp_path):
    """Every process of the run on a host killed with kill -9 (its supervisor too): its
    connection closed, and the message says that, not that it was silent. Then the launch host
    cut off: it hears from none of the other hosts, and says so, not that it lost some of them.
    (Small scale of the issue's 128 hosts: 3 hosts.)"""
    _cluster(sup, tmp_path, "/data/sv-why", ["sh", "-c", RANK + "echo up $R; exec sleep 120"], launcher="ranktable",
             hosts=3, ssh={"connect_timeout": 2, "retries": 1})
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(host_procs(sup, 3, run_id)) >= 2, 20)
    kill_run_on(sup, 3, run_id)
    assert wait_until(lambda: leftovers(run_id) == [], 30), leftovers(run_id)
    st = _status(tmp_path, rc=1)
    assert st["state"] == "lost" and st["lost"] == [sup.host(3).name], st
    assert f"lost contact with host {sup.host(3).name} (rank 2): the connection to its supervisor closed" \
        in st["message"] and "silent" not in st["message"], st["message"]

    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    # every rank runs: every host has joined (the supervisors alone are 3 processes; cut off
    # with a host yet to join, the run ends before it started, which another message says)
    assert wait_until(lambda: len(leftovers(run_id, "sleep")) == 3, 20)
    sup.link(1, False)
    try:
        assert wait_until(lambda: host_procs(sup, 1, run_id) == [], 40)
    finally:
        sup.link(1, True)
    st = _status(tmp_path, "--run", run_id, rc=1)
    assert st["state"] == "lost", st
    assert f"the launch host {sup.host(1).name} heard nothing from any of the 2 other hosts" in st["message"], st
    assert "lost contact with host" not in st["message"]
    assert wait_until(lambda: leftovers(run_id) == [], 30), leftovers(run_id)



def test_attached_up_with_the_launch_host_cut_off_ends_soon_saying_what_was_seen(sup, tmp_path):
    """The launch host cut off while `orch up` follows the run: once its stream has been silent
    as long as the supervisors wait for each other, the controller tries the launch host once
    (one connect, not ssh.retries of them), then says what it saw (the launch host did not
    answer) and what the other hosts recorded, and exits 1 (the run is lost). Its time: the
    silence waited for by design, one connect_timeout, and what a healthy status costs."""
    ssh = {"connect_timeout": 2, "retries": 4}   # retries would cost 4 x 2 s more each time
    _cluster(sup, tmp_path, "/data/sv-upcut", ["sh", "-c", RANK + "echo up $R; exec sleep 120"],
             launcher="ranktable", hosts=3, ssh=ssh)
    proc = spawn_orch("up", "-q", "--skip-checks", cwd=tmp_path)
    try:
        assert wait_until(lambda: running(tmp_path), 30), "the run did not start"
        run_id = run_record(tmp_path)["id"]
        assert wait_until(lambda: len(leftovers(run_id, "sleep")) == 3, 20), leftovers(run_id)   # every host joined
        _, healthy = timed(orch, "status", cwd=tmp_path, check_rc=0)
        sup.link(1, False)
        try:
            (_, err_b), took = timed(proc.communicate, timeout=180)
            assert wait_until(lambda: host_procs(sup, 2, run_id) == [] and host_procs(sup, 3, run_id) == [], 30)
        finally:
            sup.link(1, True)
    finally:
        proc.kill()
    err = err_b.decode()
    print(f"launch host cut during `orch up`: the controller exited {took:.1f}s after the cut "
          f"(a healthy status: {healthy:.1f}s)\n{err}")
    assert proc.returncode == 1, err
    head = sup.host(1).name
    assert f"run {run_id} lost: nothing heard from the launch host {head} for " in err, err
    assert "and it did not answer one more try" in err and "The other hosts recorded: ranks 1-2 lost" in err, err
    assert "stopping every process" not in err, err   # the hosts that answered had stopped their ranks
    rec = run_record(tmp_path, run_id)
    assert rec["state"] == "lost" and {r["rank"]: r["state"] for r in rec["ranks"]}[1] == "lost", rec
    window = max(10, 2 * ssh["connect_timeout"])   # supervisor.lost_after
    assert took < budget(healthy, window + 5 + ssh["connect_timeout"]), took
    assert wait_until(lambda: leftovers(run_id) == [], 30), leftovers(run_id)



def test_status_of_an_ended_run_asks_the_launch_host_alone_when_every_host_left_nothing(sup, tmp_path):
    """Each member's supervisor tells the head, as it ends, that nothing of the run is left on its
    host; the head records it. Plain `orch status` of that ended run then connects to the launch
    host only (one round trip, not one per host: 5-6 s at 128 hosts), says nothing is left
    running, and still answers, as fast, with the other hosts cut off."""
    ssh = {"connect_timeout": 2, "retries": 3}   # asking a cut-off host: 3 x 2 s
    _cluster(sup, tmp_path, "/data/sv-ended", ["sh", "-c", RANK + "echo hi $R"], launcher="ranktable", hosts=3,
             ssh=ssh)
    orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    run_id = run_ids(tmp_path)[-1]
    assert wait_until(lambda: leftovers(run_id) == [], 20), leftovers(run_id)

    def accepted(i: int) -> int:
        return sum("Accepted publickey" in line for line in sshd_lines(sup, i))

    before = [accepted(i) for i in (1, 2, 3)]
    st, healthy = timed(_status, tmp_path, rc=0)
    assert [accepted(i) - b for i, b in zip((1, 2, 3), before)] == [1, 0, 0]
    assert st["state"] == "succeeded" and [r["state"] for r in st["ranks"]] == ["exited"] * 3, st
    assert st["message"] == "all 3 ranks exited 0" and st["nothing_left"] is True, st
    sup.link(2, False)
    sup.link(3, False)
    try:
        res, took = timed(orch, "status", cwd=tmp_path, check_rc=0)
    finally:
        sup.link(2, True)
        sup.link(3, True)
    out = res.stdout.decode() + res.stderr.decode()
    print(f"status of an ended run, two of its three hosts cut off: {took:.1f}s (all reachable: {healthy:.1f}s)")
    assert "nothing of the run is left running on any of its hosts" in out and "unreachable" not in out, out
    assert took < budget(healthy, ssh["connect_timeout"]), took   # less than one host's connect attempts


WRITER = ["python3", "-c", "import os, sys, time\n"
          "r, rid = os.environ['RANK_ID'], os.environ['ORCH_RUN_ID']\n"
          "sys.stdout.write((rid + ' ' + r + '\\n') * 20000); sys.stdout.flush()\n"
          "time.sleep(float(os.environ.get('HOLD', '0')))\n"]


def _expected_sha(run_id: str, rank: int) -> str:
    return hashlib.sha256(f"{run_id} {rank}\n".encode() * 20000).hexdigest()


def test_second_run_in_a_live_workdir_is_refused_force_stops_the_first_logs_intact(sup, tmp_path):
    """Two runs may not share (host, workdir) while one lives: the second `orch up` is refused
    (exit 2) naming the live run and how to stop it; `--force` stops the first, then runs. No
    run overwrites or mixes another's logs: both runs' logs are byte-exact (sha256), and the
    first run's stay on the hosts under its id."""
    _cluster(sup, tmp_path, "/data/sv-two", WRITER, launcher="ranktable", env={"HOLD": "60"})
    first = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(first)) >= 4, 20)
    res = orch("up", "-q", cwd=tmp_path, check_rc=2)
    err = res.stderr.decode()
    assert f"run {first} is still running" in err and f"orch down --run {first}" in err and "--force" in err, err
    assert len(run_ids(tmp_path)) == 1  # the refused run left no record
    _cluster(sup, tmp_path, "/data/sv-two", WRITER, launcher="ranktable", env={"HOLD": "0"})
    orch("up", "-q", "--force", cwd=tmp_path, check_rc=0)
    second = run_ids(tmp_path)[-1]
    assert second != first and leftovers(first) == [] and leftovers(second) == []
    assert _status(tmp_path, "--run", first, rc=4)["state"] == "stopped"
    for run_id in (first, second):
        for r in range(4):
            got = orch("logs", "--run", run_id, "--rank", str(r), cwd=tmp_path, check_rc=0).stdout
            assert hashlib.sha256(got).hexdigest() == _expected_sha(run_id, r), (run_id, r, len(got))
    # on the host: the latest run's logs where mpirun users look, the first run's under its id
    latest = sup.exec(1, ["cat", "/data/sv-two/log_output/1/rank.0/stdout"]).stdout
    assert latest.startswith(f"{second} 0\n")
    kept = sup.exec(1, ["sh", "-c", f"sha256sum /data/sv-two/.orch/{first}/a1/1/rank.0/stdout"]).stdout
    assert kept.split()[0] == _expected_sha(first, 0)


def test_twelve_ranks_on_one_host_rank_0_streams_live(sup, tmp_path):
    """mpirun names output directories rank.00..rank.11 when a host has 10+ ranks: `orch up`
    still streams rank 0's lines while the job runs (not only at the end)."""
    cmd = ["sh", "-c", RANK + "echo first $R; sleep 4; echo second $R"]
    _cluster(sup, tmp_path, "/data/sv-twelve", cmd, slots=12, hosts=1, launcher="mpirun")
    proc = spawn_orch("up", "--skip-checks", cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        still_running = proc.poll() is None
        rest = proc.stdout.read()
        rc = proc.wait(60)
    finally:
        proc.kill()
    assert line == b"first 0\n" and still_running, (line, proc.stderr.read().decode())
    assert rest == b"second 0\n" and rc == 0
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    assert sorted(out.splitlines()) == sorted([f"[rank {r}] first {r}" for r in range(12)] +
                                              [f"[rank {r}] second {r}" for r in range(12)])


@pytest.mark.parametrize("launcher", ["ranktable", "mpirun"])
def test_restart_after_a_failed_attempt_keeps_both_attempts_logs(sup, tmp_path, launcher):
    """`job.restarts: 1`: a rank that fails on attempt 1 only -> the whole job is stopped and
    started again; the run succeeds (exit 0); both attempts are shown with why each ended;
    each attempt's logs are kept apart (`orch logs --attempt K`, default the last); the rank
    sees ORCH_ATTEMPT."""
    cmd = ["sh", "-c", RANK + 'echo "rank $R attempt $ORCH_ATTEMPT"; '
                              'if [ "$R" = 1 ] && [ "$ORCH_ATTEMPT" = 1 ]; then exit 4; fi; sleep 1']
    _cluster(sup, tmp_path, f"/data/sv-restart-{launcher}", cmd, launcher=launcher, hosts=2, restarts=1)
    res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    err = res.stderr.decode()
    assert "attempt 1: failed: rank 1" in err and "attempt 2: succeeded" in err, err
    rec = run_record(tmp_path)
    assert [a["state"] for a in rec["attempts"]] == ["failed", "succeeded"] and rec["attempt"] == 2
    one = orch("logs", "--rank", "1", "--attempt", "1", cwd=tmp_path, check_rc=0).stdout
    two = orch("logs", "--rank", "1", cwd=tmp_path, check_rc=0).stdout
    assert (one, two) == (b"rank 1 attempt 1\n", b"rank 1 attempt 2\n")
    st = _status(tmp_path, rc=0)
    assert st["state"] == "succeeded" and len(st["attempts"]) == 2
    assert leftovers(rec["id"]) == []


def test_silent_ranks_are_a_stall_their_stacks_are_kept(sup, tmp_path):
    """`job.stall_timeout: 5`: ranks alive but silent for 5 s are a `stalled` run: each rank's
    Python stack is captured (py-spy when the host has it; here, faulthandler's dump into the
    rank's own log), then everything is stopped: exit 1, nothing left."""
    cmd = ["python3", "-c", "import time\nprint('working', flush=True)\n"
                            "def wait_for_collective():\n    time.sleep(300)\nwait_for_collective()\n"]
    _cluster(sup, tmp_path, "/data/sv-stall", ["python3", "-c", "print('working')"], launcher="ranktable", hosts=2,
             stall_timeout=5)
    _, healthy = timed(orch, "up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    _cluster(sup, tmp_path, "/data/sv-stall", cmd, launcher="ranktable", hosts=2, stall_timeout=5)
    res, took = timed(orch, "up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1)
    err = res.stderr.decode()
    assert "stalled" in err and "no rank wrote any output for 5s" in err, err
    assert took < budget(healthy, 5 + STOP_GRACE), (took, healthy)  # stall_timeout, then stop
    rec = run_record(tmp_path)
    assert rec["state"] == "stalled" and leftovers(rec["id"]) == []
    for r in range(2):
        log = orch("logs", "--rank", str(r), cwd=tmp_path, check_rc=0).stdout.decode()
        assert log.startswith("working\n") and "wait_for_collective" in log, log
    assert _status(tmp_path, rc=1)["state"] == "stalled"


def test_status_from_a_machine_that_never_ran_up(sup, tmp_path):
    """`orch status FILE` where no `orch up` ran (no local record): the latest run in the
    workdir on those hosts, as its supervisor recorded it, with the matching exit code."""
    _cluster(sup, tmp_path, "/data/sv-fresh", ["sh", "-c", RANK + '[ "$R" = 0 ] && exit 6; exit 0'],
             launcher="ranktable", hosts=2)
    orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1)
    run_id = run_ids(tmp_path)[-1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = orch("status", "--json", str(tmp_path / "cluster.yaml"), cwd=elsewhere, check_rc=1)
    st = json.loads(res.stdout)
    assert st["run"] == run_id and st["state"] == "failed" and st["first_failure"]["rank"] == 0
    table = orch("status", str(tmp_path / "cluster.yaml"), cwd=elsewhere, check_rc=1).stdout.decode()
    assert re.search(rf"run {run_id} .*failed", table) and "exit code 6" in table, table
    # --run with FILE: that run, not the latest one
    _cluster(sup, tmp_path, "/data/sv-fresh", ["true"], launcher="ranktable", hosts=2)
    orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    st = json.loads(orch("status", "--json", str(tmp_path / "cluster.yaml"), cwd=elsewhere, check_rc=0).stdout)
    assert st["run"] == run_ids(tmp_path)[-1] != run_id and st["state"] == "succeeded", st
    for where in (elsewhere, tmp_path):   # not recorded there (asked of the launch host); recorded here
        st = json.loads(orch("status", "--json", str(tmp_path / "cluster.yaml"), "--run", run_id, cwd=where,
                             check_rc=1).stdout)
        assert st["run"] == run_id and st["state"] == "failed", (where, st)
    res = orch("status", str(tmp_path / "cluster.yaml"), "--run", "20000101-000000-000000", cwd=elsewhere,
               check_rc=2)
    assert "no run 20000101-000000-000000 found in /data/sv-fresh" in res.stderr.decode()
