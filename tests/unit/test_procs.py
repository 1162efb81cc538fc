"""This host's processes (orchestrator/agent/procs.py): what waitpid says, and when."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.agent.procs import Local
from tests.support import old_setpriv, util_linux_setpriv


def test_a_childs_end_is_the_moment_it_ended_not_when_the_loop_next_looked(tmp_path):
    """The supervisor notes each child's end on SIGCHLD: a rank that ended while the loop was
    busy elsewhere keeps its own end time, so the first failure across hosts is told by when
    ranks ended, not by when each supervisor noticed."""
    local = Local({"run_id": "r", "rundir": str(tmp_path), "host": "h", "launcher": "ranktable"}, lambda t: None)
    said = tmp_path / "ended-at"
    old = signal.signal(signal.SIGCHLD, local.collect)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').write(repr(time.time()));"
                                 " sys.exit(3)", str(said)])
        proc.returncode = 0   # reaped by Local, as the supervisor's children are
        rec = {"key": "rank.0", "rank": None, "pid": proc.pid, "exit_code": None, "signal": None, "start": 0,
               "end": None}
        local.children[proc.pid] = rec
        deadline = time.monotonic() + 30
        while proc.pid not in [e[0] for e in local.exits] and time.monotonic() < deadline:   # the loop busy
            time.sleep(0.05)
        time.sleep(0.3)
        before_reap = time.time()
        local.reap()
    finally:
        signal.signal(signal.SIGCHLD, old)
    assert rec["exit_code"] == 3 and local.children == {}
    assert float(said.read_text()) <= rec["end"] < before_reap, (float(said.read_text()), rec["end"], before_reap)


def test_a_child_collected_before_it_was_recorded_is_kept_for_it(tmp_path):
    local = Local({"run_id": "r", "rundir": str(tmp_path), "host": "h", "launcher": "ranktable"}, lambda t: None)
    proc = subprocess.Popen(["true"])
    proc.returncode = 0
    deadline = time.monotonic() + 30
    while proc.pid not in [e[0] for e in local.exits] and time.monotonic() < deadline:
        local.collect()            # SIGCHLD came between the start and the record
        time.sleep(0.02)
    local.reap()                   # not known yet: kept
    rec = {"key": "k", "rank": None, "pid": proc.pid, "exit_code": None, "signal": None, "start": 0, "end": None}
    local.children[proc.pid] = rec
    local.reap()
    assert rec["exit_code"] == 0 and rec["end"] is not None and proc.pid not in [e[0] for e in local.exits]


def test_run_pids_finds_the_runs_processes_by_their_exact_id_and_not_its_supervisors():
    """A run's processes are found by ORCH_RUN_ID in their environment (each environment read
    whole, split only where the id appears): exactly that id (not one it is a prefix of), and
    never a supervisor (ORCH_AGENT=1)."""
    import subprocess

    from orchestrator.agent.procs import run_pids

    base = {"PATH": "/usr/bin:/bin"}
    ps = [subprocess.Popen(["sleep", "60"], env={**base, **extra}) for extra in (
        {"ORCH_RUN_ID": "R-pids-1"}, {"ORCH_RUN_ID": "R-pids-10"}, {"ORCH_RUN_ID": "R-pids-1", "ORCH_AGENT": "1"},
        {"X": "ORCH_RUN_ID=R-pids-1"})]
    try:
        assert run_pids("R-pids-1") == [ps[0].pid]
    finally:
        for p in ps:
            p.kill()
            p.wait()


def test_setpriv_is_used_only_where_it_can_give_a_death_signal(tmp_path, monkeypatch):
    """procs._try_setpriv: util-linux >= 2.33's setpriv (this machine's) is taken; one that lacks
    --pdeathsig (it stops at the option, exit 1), one that hangs (killed after the wait), none at all: fork, as before."""
    from orchestrator.agent import procs

    real = util_linux_setpriv()
    assert procs._try_setpriv(real) == real
    assert procs._try_setpriv(str(old_setpriv(tmp_path / "old"))) is None
    hangs = tmp_path / "hanging-setpriv"
    hangs.write_text("#!/bin/sh\nexec sleep 60\n")
    hangs.chmod(0o755)
    monkeypatch.setattr(procs, "SETPRIV_TRY_WAIT", 0.3)
    assert procs._try_setpriv(str(hangs)) is None   # unbounded, its sleep would end 0: taken
    assert procs._try_setpriv(None) is None


def test_a_setpriv_that_can_is_tried_once_per_host_and_only_a_yes_in_a_private_place_is_kept(tmp_path,
                                                                                             monkeypatch):
    """kept_setpriv: the first supervisor tries this setpriv and keeps its yes in the agent's
    directory; the next takes it without a try. A no is not kept; nor is anything trusted from a
    directory others may write, a link in the mark's place, or a mark for another setpriv."""
    from orchestrator.agent import procs

    real = util_linux_setpriv()
    tries = []
    answer = {"ok": True}
    monkeypatch.setattr(procs, "_try_setpriv", lambda p: tries.append(p) or (p if answer["ok"] else None))
    home = tmp_path / "agent-x"
    home.mkdir(mode=0o700)
    assert procs.kept_setpriv(real, str(home)) == real and len(tries) == 1
    marks = list(home.iterdir())
    assert len(marks) == 1 and marks[0].stat().st_size == 0 and (marks[0].stat().st_mode & 0o777) == 0o600
    assert procs.kept_setpriv(real, str(home)) == real and len(tries) == 1   # taken, not tried
    copy = tmp_path / "bin" / "setpriv"                                    # another setpriv: its own try
    copy.parent.mkdir()
    copy.write_bytes(Path(real).read_bytes())
    copy.chmod(0o755)
    assert procs.kept_setpriv(str(copy), str(home)) == str(copy) and len(tries) == 2
    home.chmod(0o770)                                                       # others may write there: tried
    assert procs.kept_setpriv(real, str(home)) == real and len(tries) == 3
    home.chmod(0o700)
    for m in home.iterdir():                                               # a link in the mark's place
        m.unlink()
        m.symlink_to(tmp_path / "elsewhere")
    answer["ok"] = False
    assert procs.kept_setpriv(real, str(home)) is None and len(tries) == 4
    assert procs.kept_setpriv(real, str(home)) is None and len(tries) == 5  # a no: tried again each time
    assert procs.kept_setpriv(real, None) is None and len(tries) == 6
    assert procs.package_home() is None                                       # orch's own tree: nothing kept


def test_the_setpriv_try_waits_for_its_own_child_whatever_sigchld_is(tmp_path):
    """Ignored SIGCHLD (inherited through exec: the kernel then reaps every child at once) or a
    handler that reaps: the try still sees its child's exit status, and the disposition is put back."""
    from orchestrator.agent import procs

    real = util_linux_setpriv()
    reaped = []

    def reaper(*_):
        try:
            reaped.append(os.waitpid(-1, os.WNOHANG))
        except ChildProcessError:
            pass

    for disposition in (signal.SIG_IGN, reaper):
        old = signal.signal(signal.SIGCHLD, disposition)
        try:
            assert procs._try_setpriv(real) == real
            assert signal.getsignal(signal.SIGCHLD) is disposition
        finally:
            signal.signal(signal.SIGCHLD, old)


def test_while_a_stop_goes_on_a_process_of_the_run_that_is_no_child_keeps_the_host_live(tmp_path):
    """The head ends an attempt once every host reports nothing live. A launcher that dies on TERM
    can leave a worker behind (no child of the supervisor, no rank record of its own): until the
    stop has killed it, the host's report says live, so `orch up` never returns with it running."""
    run_id = f"R-orphan-{os.getpid()}-{time.monotonic_ns()}"
    local = Local({"run_id": run_id, "rundir": str(tmp_path), "host": "h", "launcher": "msrun"}, lambda t: None)
    # it outlives the stop's TERM (as a worker busy in a collective would, until the KILL)
    orphan = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 60"], env={"PATH": "/usr/bin:/bin",
                                                                                "ORCH_RUN_ID": run_id})
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{orphan.pid}/comm").read().strip() != "sleep":   # TERM ignored from here on
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert local.report()["live"] is False   # no stop: what is not ours is not scanned for
        local.stop("a test", 5.0)
        assert local.report()["live"] is True
        assert local.stop_tick() is False and local.report()["live"] is True   # it outlived the TERM
        orphan.kill()
        orphan.wait()
        assert local.stop_tick() is True and local.report()["live"] is False
    finally:
        orphan.kill()
        orphan.wait()


def test_a_stop_with_nothing_of_the_run_left_is_not_live_from_its_first_report(tmp_path):
    """The end of a run that succeeded: the head's stop finds nothing of the run on the host, whose
    next report says so at once (the head ends the run without waiting for another turn here)."""
    local = Local({"run_id": f"R-none-{os.getpid()}", "rundir": str(tmp_path), "host": "h", "launcher": "msrun"},
                  lambda t: None)
    local.stop("the end", 5.0)
    assert local.report()["live"] is False


def test_a_ranks_log_is_looked_for_until_it_is_there_then_read_where_it_is(tmp_path, monkeypatch):
    """watch_output finds each rank's log once (rank_log: a stat, and mpirun's other layouts by
    listing the directory) and then only stats it, each poll; a log not there yet is looked for again."""
    from orchestrator.agent import procs
    from orchestrator.agent.layout import attempt_dir

    local = Local({"run_id": "r", "rundir": str(tmp_path), "host": "h", "launcher": "mpirun"}, lambda t: None)
    local.ranks = {0: {}, 1: {}}
    looked = []
    real = procs.rank_log
    monkeypatch.setattr(procs, "rank_log", lambda adir, rank, launcher: looked.append(rank) or real(adir, rank, launcher))
    adir = attempt_dir(str(tmp_path), local.attempt)
    (Path(adir) / "1" / "rank.0").mkdir(parents=True)
    (Path(adir) / "1" / "rank.0" / "stdout").write_text("a\n")
    for _ in range(3):
        local.watch_output()
    assert looked.count(0) == 1 and looked.count(1) == 3        # rank 1's log is not there yet
    (Path(adir) / "1" / "rank.01").mkdir()                      # a zero-padded layout: found by listing
    (Path(adir) / "1" / "rank.01" / "stdout").write_text("b\n")
    local.watch_output()
    local.watch_output()
    (Path(adir) / "1" / "rank.0" / "stdout").write_text("a\nmore\n")
    local.watch_output()
    assert looked.count(0) == 1 and looked.count(1) == 4
    assert local.sizes == {0: 7, 1: 2} and local.grew
