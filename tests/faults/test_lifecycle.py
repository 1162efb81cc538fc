"""Scenarios 5-7: a rank killed by the kernel, the controller killed, a full disk; and hosts whose
sshd takes one SSH session at a time."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from orchestrator import sh
from orchestrator.launchers import RUN_VAR
from tests.support import (leftovers, orch, remote_ls, run_ids, run_record, spawn_orch,
                           up_then_kill_controller, wait_until, write_fault_cluster)

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
    write_fault_cluster(life, tmp_path, workdir=wd, launcher=launcher, hosts=2,
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
    ff = rec["first_failure"]
    assert ff["rank"] == 3 and ff["signal"] == 9 and ff["exit_code"] is None, ff  # a signal, not a code
    assert leftovers(rec["id"]) == []
    # the rank's log holds what the rank wrote, no shell's "Killed" note added
    assert orch("logs", "--rank", "3", cwd=tmp_path, check_rc=0).stdout == b"up 3\n"


TICKER = ["sh", "-c", "for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done; exec sleep 120"]


def test_controller_killed_job_runs_on_and_can_be_reattached_and_stopped(life, tmp_path):
    """Scenario 6. `orch up` SIGKILLed mid-job (no chance to clean up): the job keeps running;
    `orch status` shows every rank running; `orch logs -f` reattaches and streams the rank's
    output from the start; `orch down` stops every process of the run (the follower then
    ends by itself) and records the run as stopped, leaving nothing behind."""
    write_fault_cluster(life, tmp_path, workdir="/data/fx-ctlkill", launcher="ranktable", command=TICKER)
    run_id = up_then_kill_controller(tmp_path, procs=12)
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
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=4).stdout)  # 4: stopped
    assert st["state"] == "stopped" and all(r["state"] == "stopped" for r in st["ranks"]), st


def test_full_workdir_fails_distribution_before_anything_starts(life, tmp_path):
    """Scenario 7. A host whose workdir is full fails the distribution step before launch:
    the error names the host and the file that could not be written (no space left), no
    half-written temp file stays behind, nothing is started on any host, exit 1. With the
    preflight checks on, `orch up` stops even earlier (exit 3)."""
    wd = "/data/fx-full"
    (tmp_path / "big.bin").write_bytes(os.urandom(256 * 1024))
    write_fault_cluster(life, tmp_path, workdir=wd, launcher="ranktable", sync=["big.bin"],
                        command=["sh", "-c", "echo started; sleep 30"])
    life.exec(2, ["mkdir", "-p", wd], check=True)
    life.exec(2, ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", wd], check=True)
    try:
        res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1)
        err = res.stderr.decode()
        assert "distribution failed; nothing was started" in err, err
        assert f"{life.host(2).name}: cannot write {wd}/big.bin" in err and "No space left" in err, err
        assert remote_ls(life, 2, f"{wd}/.orch-put.*") == [] and remote_ls(life, 2, f"{wd}/.orch-sync-partial.*") == []
        rec = run_record(tmp_path)
        assert rec["state"] == "failed" and rec["procs"] == [] and leftovers(rec["id"]) == []
        for i in (1, 2, 3):
            assert remote_ls(life, i, f"{wd}/log_output/1/rank.*") == []
        res = orch("up", "-q", cwd=tmp_path, check_rc=3)
        assert life.host(2).name in res.stdout.decode() + res.stderr.decode()
        assert len(run_ids(tmp_path)) == 1
    finally:
        life.exec(2, ["umount", wd])


def test_mpiruns_own_error_is_quoted_not_hidden(life, tmp_path):
    """mpirun that cannot reach a host (its ssh refused on another port) exits 255: orch says
    exit code 255 (not a signal), quotes ssh's own words and OpenMPI's summary, names the log."""
    write_fault_cluster(life, tmp_path, workdir="/data/fx-mpierr", launcher="mpirun", command="true",
                        mpirun_args=["--mca", "plm_rsh_args", "-p 2222"])
    err = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1).stderr.decode()
    assert "mpirun on" in err and "failed: exit code 255" in err and "signal" not in err, err
    assert "port 2222: Connection refused" in err and "ORTE was unable to reliably start" in err, err
    assert "/a1/mpirun.log" in err


def test_mpiruns_failure_leads_not_the_sigterm_it_sent_and_is_quoted_whole(life, tmp_path):
    """A rank asks mpirun to start a program that does not exist (MPI Spawn): mpirun takes the
    job down (its ranks die of SIGTERM) and exits 132. The run's message is mpirun's failure,
    with its own words whole, from the error to the Executable: and Node: lines that name the
    cause; not "rank 1 ... killed by signal 15 (SIGTERM)"."""
    venv = Path(os.environ.get("ORCH_TRAIN_VENV", "/opt/orch-venvs/train"))
    script = tmp_path / "spawn.py"
    script.write_text("from mpi4py import MPI\nimport time\n"
                      "if MPI.COMM_WORLD.Get_rank() == 1:\n    MPI.COMM_SELF.Spawn('/nonexistent/prog', maxprocs=1)\n"
                      "time.sleep(60)\n")
    write_fault_cluster(life, tmp_path, workdir="/data/fx-spawn", launcher="mpirun", hosts=2,
                        command=[str(venv / "bin" / "python"), "spawn.py"], sync=[str(script)],
                        mpirun_args=["--oversubscribe"])   # a slot free for the spawn: mpirun tries to launch it
    err = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1).stderr.decode()
    assert "mpirun on" in err and "failed: exit code 132" in err and "SIGTERM" not in err, err
    assert "mpirun was unable to launch the specified application" in err, err
    assert "Executable: /nonexistent/prog" in err and "Node: " in err, err
    assert "/a1/mpirun.log" in err
    rec = run_record(tmp_path)
    assert rec["state"] == "failed" and rec["first_failure"] is None, rec


def test_down_with_a_host_cut_off_says_unknown_and_finds_mpiruns_daemons(life, tmp_path):
    """Every process a run starts is findable by its run id, OpenMPI's daemons (orted) on the
    other hosts included. `orch down` while a host is cut off stops the rest, exits 1 and records
    that host's ranks as unknown, not stopped; run again once the host is back, it stops them."""
    write_fault_cluster(life, tmp_path, workdir="/data/fx-down-cut", launcher="mpirun",
                        command=["sh", "-c", "sleep 300"], ssh={"connect_timeout": 2, "retries": 1},
                        inventory={"defaults": {**yaml.safe_load(Path(life.inventory_path).read_text())["defaults"],
                                                "slots": 1}})
    run_id = orch("up", "--detach", "-q", "--skip-checks", cwd=tmp_path, check_rc=0).stdout.decode().strip()

    def run_cmdlines(i: int) -> list[str]:
        return life.exec(i, ["sh", "-c", f"for p in $({sh.env_holders(RUN_VAR, run_id)}); do "
                                         "tr '\\0' ' ' < ${p%/environ}/cmdline; echo; done 2>/dev/null; true"]
                         ).stdout.splitlines()

    assert wait_until(lambda: all(any(c.startswith("orted ") for c in run_cmdlines(i)) for i in (2, 3)),
                      timeout=30), (run_cmdlines(2), run_cmdlines(3))
    life.link(3, False)
    try:
        res = orch("down", cwd=tmp_path, check_rc=1)
        err = res.stderr.decode()
        assert f"stopped except on {life.host(3).name}" in err and "state is unknown" in err, err
        rec = run_record(tmp_path, run_id)
        assert {r["host"]: r["state"] for r in rec["ranks"]}[life.host(3).name].startswith("unknown"), rec["ranks"]
        assert "not reached" in rec["message"]
    finally:
        life.link(3, True)
    orch("down", "--run", run_id, cwd=tmp_path, check_rc=0)
    assert wait_until(lambda: leftovers(run_id) == [], timeout=30), leftovers(run_id)


def test_down_with_the_launch_host_cut_off_records_nothing_then_the_clusters_verdict(life, tmp_path):
    """`orch down` while the launch host is cut off cannot know how the run ended (its head
    holds that): exit 1, nothing recorded. Once the link is back, `orch down` says and records
    what the cluster had decided (`lost`: the head heard from no other host), its words and its
    JSON alike; no line per host."""
    write_fault_cluster(life, tmp_path, workdir="/data/fx-down-head", launcher="ranktable",
                        command=["sh", "-c", "sleep 300"], ssh={"connect_timeout": 2, "retries": 1})
    run_id = orch("up", "--detach", "-q", "--skip-checks", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(leftovers(run_id)) >= 6, 30)
    life.link(1, False)
    try:
        err = orch("down", cwd=tmp_path, check_rc=1).stderr.decode()
        assert f"could not stop on {life.host(1).name}" in err and "state is unknown" in err, err
        assert run_record(tmp_path, run_id).get("ended") is None, run_record(tmp_path, run_id)
        assert wait_until(lambda: leftovers(run_id) == [], 40), leftovers(run_id)   # the head ends it, lost
    finally:
        life.link(1, True)
    err = orch("down", cwd=tmp_path, check_rc=0).stderr.decode()
    assert f"run {run_id} had already ended: lost (the launch host {life.host(1).name} heard nothing" in err, err
    assert err.startswith("orch: nothing of the run left running on ") and err.count("\n") == 2, err
    assert run_record(tmp_path, run_id)["state"] == "lost"
    res = orch("down", "--json", cwd=tmp_path, check_rc=0)   # again: the same word in its JSON and its line
    assert json.loads(res.stdout)["state"] == "lost"
    assert f"run {run_id} had already ended: lost (its record is kept)" in res.stderr.decode()


def test_an_mpirun_that_cannot_start_says_why(life, tmp_path):
    """A 200 KB env value makes mpirun's command line too long to start: orch says so (E2BIG,
    'Argument list too long'), not that ranks did not report."""
    write_fault_cluster(life, tmp_path, workdir="/data/fx-e2big", launcher="mpirun", command="true",
                        env={"BIG": "x" * 200_000})
    err = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1).stderr.decode()
    assert "cannot start mpirun: Argument list too long" in err and "did not report" not in err, err[-2000:]


@pytest.fixture(scope="module")
def one_session(fx_lab):
    """A 2-host lab whose SSH servers take one session at a time on a connection (MaxSessions 1)."""
    import socket

    lab = fx_lab("m", 2)
    for i in (1, 2):
        conf = lab.host_dir(i) / "sshd_config"
        conf.write_text(conf.read_text().replace("MaxSessions 200", "MaxSessions 1"))
        assert "MaxSessions 1\n" in conf.read_text()
        lab.exec(i, ["sh", "-c", f"kill -HUP \"$(cat {lab.host_dir(i)}/sshd.pid)\""], check=True)

    def listening(address: str) -> bool:
        try:
            socket.create_connection((address, 22), timeout=1).close()
            return True
        except OSError:
            return False

    assert all(wait_until(lambda a=h.address: listening(a), 10) for h in lab.hosts)   # sshd, re-executed
    return lab


@pytest.mark.parametrize("sync_via", ["launch-host", "controller"])
def test_hosts_that_take_one_ssh_session_at_a_time_sync_then_start(one_session, tmp_path, sync_via):
    """Every host's sshd takes one session per connection (sshd_config MaxSessions 1): a start
    waiting beside the sync cannot have a second one there. `orch up`, with its preflight and
    without, still syncs the change and runs. Whichever had the session first decides what is said:
    the sync refused (the launch host's start is usually first), the sync then the starts run one
    after the other, and `up` says why; a start refused waits for the sync, nothing said
    (test_head_reach has both, in order)."""
    f = write_fault_cluster(one_session, tmp_path, command=["python3", "train.py"], launcher="mpirun",
                            sync=["train.py"], sync_via=sync_via, workdir=f"/data/fxm-{sync_via}")
    for args in ([], ["--skip-checks"]):
        (tmp_path / "train.py").write_text(f"print('trained {len(args)}')\n")   # a change: the sync has work
        res = orch("up", f, *args, cwd=tmp_path, check_rc=0, text=True)
        assert f"trained {len(args)}" in res.stdout
        said = [line for line in res.stderr.splitlines() if "warning" in line]
        for line in said:   # at most one, naming lab hosts and MaxSessions
            hosts, _, why = line.removeprefix("orch: warning: ").partition(": ")
            assert set(hosts.split(", ")) <= {h.name for h in one_session.hosts}, res.stderr
            assert why.startswith("the SSH server takes one session at a time there (sshd_config MaxSessions 1)")
        assert len(said) <= 1, res.stderr
        assert run_record(tmp_path)["state"] == "succeeded"


def test_sessions_one_after_another_on_a_host_that_takes_one_at_a_time_are_not_refused(one_session, tmp_path):
    """sshd frees a session's place a moment after the session ends (once both sides' CLOSE have
    crossed, in its next loop): where it takes one session at a time, the next one asked for in
    that moment was refused (a CI run's gather, just after its watch ended there; 2 in 300 here
    on a loaded machine). 500 sessions one after the other, the machine kept busy: none refused."""
    import subprocess

    from orchestrator.spec import load_cluster
    from orchestrator.transport import Pool

    c = load_cluster(write_fault_cluster(one_session, tmp_path, command=["true"], launcher="mpirun"))
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(3)]
    try:
        with Pool(c) as pool:
            t = pool[c.hosts[0]]
            for _ in range(500):
                assert t.run("true").ok
    finally:
        for p in busy:
            p.kill()
            p.wait()
