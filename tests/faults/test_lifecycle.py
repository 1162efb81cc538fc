"""Scenarios 5-7: a rank killed by the kernel, the controller killed, a full disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from .helpers import (leftovers, orch, remote_ls, run_ids, run_record, running, spawn_orch, wait_until,
                      write_cluster)

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def life(fx_lab):
    return fx_lab("l", 3)


@pytest.mark.parametrize("launcher", ["ranktable", "mpirun"])
def test_rank_killed_by_sigkill_is_reported_as_signal_9(life, tmp_path, launcher):
    """Scenario 5. A rank killed with SIGKILL (as the OOM killer does) is reported as
    `killed by signal 9 (SIGKILL)`, naming the rank and its host, even when the launcher then
    takes the other ranks down with other signals; the job is stopped everywhere, exit 1; the
    rank's log holds exactly what it wrote (no "Killed" from a shell of orch's)."""
    wd = f"/data/fx-oom-{launcher}"
    write_cluster(life, tmp_path, workdir=wd, launcher=launcher, hosts=2,
                  command=["sh", "-c", 'R=${OMPI_COMM_WORLD_RANK:-$RANK_ID}; echo $$ > pid.$R; echo up $R; '
                                       'exec sleep 60'])
    life.exec(2, ["rm", "-f", f"{wd}/pid.3"])
    proc = spawn_orch("up", "-q", cwd=tmp_path)
    try:
        assert wait_until(lambda: life.exec(2, ["cat", f"{wd}/pid.3"]).stdout.strip().isdigit(), 60)
        time.sleep(0.5)
        pid = life.exec(2, ["cat", f"{wd}/pid.3"]).stdout.strip()
        life.exec(2, ["kill", "-KILL", pid], check=True)
        rc = proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert rc == 1, err
    assert f"rank 3 on {life.host(2).name}" in err and "killed by signal 9 (SIGKILL)" in err, err
    rec = run_record(tmp_path)
    assert rec["first_failure"]["rank"] == 3 and rec["first_failure"]["exit_code"] == 128 + 9, rec["first_failure"]
    assert leftovers(rec["id"]) == []
    # the rank's log holds what the rank wrote, no shell's "Killed" note added
    assert orch("logs", "--rank", "3", cwd=tmp_path, check_rc=0).stdout == b"up 3\n"


TICKER = ["sh", "-c", "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done; exec sleep 120"]


def test_controller_killed_job_runs_on_and_can_be_reattached_and_stopped(life, tmp_path):
    """Scenario 6. `orch up` SIGKILLed mid-job (no chance to clean up): the job keeps running;
    `orch status` shows every rank running; `orch logs -f` reattaches and streams the rank's
    output from the start; `orch down` stops every process of the run (the follower then
    ends by itself) and records the run as stopped, leaving nothing behind."""
    write_cluster(life, tmp_path, workdir="/data/fx-ctlkill", launcher="ranktable", command=TICKER)
    proc = spawn_orch("up", cwd=tmp_path, stdout=subprocess.PIPE)
    try:
        assert wait_until(lambda: running(tmp_path), 60)
        run_id = run_record(tmp_path)["id"]
        assert wait_until(lambda: len(leftovers(run_id)) >= 12, 30)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    time.sleep(0.5)
    assert len(leftovers(run_id)) >= 12, "the job died with its controller"
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert st["run"] == run_id and [r["state"] for r in st["ranks"]] == ["running"] * 6, st
    follower = spawn_orch("logs", "-f", "--rank", "4", cwd=tmp_path)
    try:
        got = b""
        deadline = time.monotonic() + 30
        while b"tick 6\n" not in got and time.monotonic() < deadline:
            got += follower.stdout.read1(4096)
        assert got == b"".join(b"tick %d\n" % i for i in range(1, 7)), got
        down = orch("down", cwd=tmp_path, check_rc=0)
        assert follower.wait(30) == 0, follower.stderr.read().decode()
        assert follower.stdout.read() == b""
    finally:
        follower.kill()
    assert leftovers(run_id) == [], down.stderr.decode()
    assert run_record(tmp_path, run_id)["state"] == "stopped"
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert all(r["state"].startswith("killed") for r in st["ranks"]), st  # some may say: by SIGTERM


def test_full_workdir_fails_distribution_before_anything_starts(life, tmp_path):
    """Scenario 7. A host whose workdir is full fails the distribution step before launch:
    the error names the host and the file that could not be written (no space left), no
    half-written temp file stays behind, nothing is started on any host, exit 1. With the
    preflight checks on, `orch up` stops even earlier (exit 3)."""
    wd = "/data/fx-full"
    (tmp_path / "big.bin").write_bytes(os.urandom(256 * 1024))
    write_cluster(life, tmp_path, workdir=wd, launcher="ranktable", sync=["big.bin"],
                  command=["sh", "-c", "echo started; sleep 30"])
    life.exec(2, ["mkdir", "-p", wd], check=True)
    life.exec(2, ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", wd], check=True)
    try:
        res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1)
        err = res.stderr.decode()
        assert "distribution failed; nothing was started" in err, err
        assert f"{life.host(2).name}: cannot write {wd}/big.bin" in err and "No space left" in err, err
        assert remote_ls(life, 2, f"{wd}/.orch-put.*") == []
        rec = run_record(tmp_path)
        assert rec["state"] == "failed" and rec["procs"] == [] and leftovers(rec["id"]) == []
        for i in (1, 2, 3):
            assert remote_ls(life, i, f"{wd}/log_output/1/rank.*") == []
        res = orch("up", "-q", cwd=tmp_path, check_rc=3)
        assert life.host(2).name in res.stdout.decode() + res.stderr.decode()
        assert len(run_ids(tmp_path)) == 1
    finally:
        life.exec(2, ["umount", wd])


def test_first_failure_is_the_earliest_not_the_first_listed(tmp_path):
    """Scenario 5 (which rank is named). When several ranks have failed by the time orch looks
    (one crashed, the others died of it), the rank named is the one whose exit code was written
    first, on whichever host, not the lowest rank or the first host polled. Pure: no lab."""
    from orchestrator import launch
    from orchestrator.plan import make_plan
    from orchestrator.runs import create_run
    from orchestrator.spec import load_cluster
    from orchestrator.transport import Pool

    (tmp_path / "c.yaml").write_text("inventory: {defaults: {slots: 2}, hosts: [{address: 10.0.0.1}, "
                                     "{address: 10.0.0.2}]}\njob: {launcher: ranktable, workdir: /d, command: x}\n")
    cluster = load_cluster(tmp_path / "c.yaml")
    rp = make_plan(cluster)
    with Pool(cluster) as pool:
        lc = launch.Lifecycle(cluster, rp, create_run(cluster, rp.to_dict(), cwd=tmp_path), pool)
        lc.absorb({"10.0.0.1": launch.parse_poll("rc rank.0.rc 1 1700000010.5\nrc rank.1.rc 0 1700000000.0\n"),
                   "10.0.0.2": launch.parse_poll("rc rank.3.rc 137 1700000009.25\nrc rank.2.rc 1 1700000011.0\n")})
    assert lc.first_failure["rank"] == 3 and lc.first_failure["how"] == "killed by signal 9 (SIGKILL)"
    assert lc.exit_codes == {0: 1, 1: 0, 2: 1, 3: 137}
