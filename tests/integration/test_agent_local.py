"""The supervisor as the hosts run it (agent.py and its package, the machine's python3), on this
machine alone: what happens when it dies. No lab, no network but loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import old_setpriv, util_linux_setpriv
from tests.unit.test_launchers import install_agent

PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


def config(tmp_path: Path, procs: list[dict], ranks: list[int]) -> dict:
    rundir = tmp_path / "wd" / ".orch" / "R1"
    return {"run_id": "R1", "host": "h1", "role": "head", "token": "ab" * 16, "orch_version": "test",
            "head_addresses": ["127.0.0.1"], "head_pinned": True, "head_port": None, "rundir": str(rundir),
            "workdir": str(tmp_path / "wd"), "log_link": str(tmp_path / "wd" / "log_output"),
            "launcher": "ranktable", "on_failure": "stop", "restarts": 0, "restart_delay": 0, "stall_timeout": None,
            "timeout": None, "grace": 1, "lost_after": 10, "join_timeout": 10,
            "ranks": [{"rank": r, "device": r} for r in ranks], "procs": procs, "secret_env": {},
            "hosts": ["h1"], "all_ranks": [{"rank": r, "host": "h1", "device": r, "pid": None, "state": "pending",
                                            "exit_code": None, "signal": None, "start": None, "end": None,
                                            "attempt": 0} for r in ranks]}


def rank_proc(r: int, argv: list, env: dict | None = None) -> dict:
    return {"key": f"rank.{r}", "argv": argv, "env": env or {}, "cwd": "/", "log": f"1/rank.{r}/stdout", "rank": r,
            "env_log": False}


def start(tmp_path: Path, cfg: dict, path: str = "/usr/bin:/bin") -> subprocess.Popen:
    rundir = Path(cfg["rundir"])
    rundir.mkdir(parents=True)
    install_agent(rundir)
    env = {"PATH": path, "ORCH_RUN_ID": cfg["run_id"], "ORCH_AGENT": "1"}
    p = subprocess.Popen([PY, "-S", str(rundir / "agent.py"), "start", str(rundir), "--foreground"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    p.stdin.write(json.dumps(cfg).encode())
    p.stdin.close()
    return p


def state(cfg) -> dict:
    try:
        return json.loads((Path(cfg["rundir"]) / "state.json").read_text())
    except (OSError, ValueError):
        return {}


def wait(cond, limit=20.0):
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def host_path(tmp_path: Path, spawn: str) -> str:
    """PATH of a host whose supervisor starts processes `spawn`: "setpriv" (util-linux >= 2.33's
    setpriv, this machine's), "fork" (a setpriv without --pdeathsig first on PATH, as on CentOS 7)."""
    if spawn == "setpriv":
        util_linux_setpriv()
        return "/usr/bin:/bin"
    return f"{old_setpriv(tmp_path / 'old-util-linux').parent}:/usr/bin:/bin"


def spawned(cfg: dict, spawn: str) -> None:
    """The supervisor said how it starts processes, as the host made it."""
    log = (Path(cfg["rundir"]) / "agent.log").read_text()
    said = "through /usr/bin/setpriv --pdeathsig" if spawn == "setpriv" else "by fork (no setpriv with --pdeathsig"
    assert f"processes start {said}" in log, log


@pytest.mark.parametrize("spawn", ["setpriv", "fork"])
def test_a_supervisor_killed_by_sigkill_takes_its_ranks_with_it(tmp_path, spawn):
    """kill -9 of a host's supervisor (the OOM killer, a careless admin): its ranks, in sessions of
    their own, do not outlive it (they die with their parent: PR_SET_PDEATHSIG), whether setpriv
    gave them the signal or the supervisor's fork did."""
    cfg = config(tmp_path, [rank_proc(0, ["sleep", "300"]), rank_proc(1, ["sleep", "300"])], [0, 1])
    p = start(tmp_path, cfg, host_path(tmp_path, spawn))
    try:
        def started():
            doc = state(cfg)
            return doc.get("state") == "running" and doc["ranks"] and all(r.get("pid") for r in doc["ranks"])

        wait(started)
        pids = [r["pid"] for r in state(cfg)["ranks"]]
        assert all(alive(x) for x in pids)
        t0 = time.monotonic()
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        wait(lambda: not any(alive(x) for x in pids), 10)
        print(f"\nsupervisor SIGKILLed: its ranks gone {time.monotonic() - t0:.3f} s later")
        spawned(cfg, spawn)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("spawn", ["setpriv", "fork"])
def test_a_rank_starts_as_popen_would_start_it_or_orch_says_why_not(tmp_path, spawn):
    """Either way a rank starts in its cwd, its own session, with SIGPIPE's default action (python
    ignores it) and no descriptor of the supervisor's beyond 0-2; a program that cannot start is
    orch's "cannot start" with the exec's reason and exit code 127 (not setpriv's words): not on the
    rank's PATH, not executable (there, or on PATH), a script whose interpreter is missing, a file
    with no "#!" that is no program (not run by /bin/sh, as setpriv's execvp would)."""
    cwd, bindir = tmp_path / "cwd", tmp_path / "bin"
    cwd.mkdir()
    bindir.mkdir()
    for where, name, text, mode in ((cwd, "not-executable", "echo no\n", 0o644), (bindir, "on-path", "echo no\n", 0o644),
                                    (cwd, "bad-interpreter", "#!/no/such/python\nprint(1)\n", 0o755),
                                    (cwd, "no-shebang", "echo ran by sh\n", 0o755),
                                    (cwd, "good-script", "#!/bin/sh\necho script $1\n", 0o755)):
        (where / name).write_text(text)
        (where / name).chmod(mode)
    probe = "pwd; grep SigIgn /proc/self/status; echo $(ls /proc/self/fd); ps -o sid= -p $$; echo pid $$"
    path = {"PATH": f"{bindir}:/usr/bin:/bin"}
    argvs = [["sh", "-c", probe], ["no-such-program", "x"], ["/no/such/program"], ["./not-executable"],
             ["on-path"], ["./bad-interpreter"], ["./no-shebang"], ["./good-script", "ok"]]
    procs = [rank_proc(r, argv, env=path) for r, argv in enumerate(argvs)]
    for p in procs:
        p["cwd"] = str(cwd)
    cfg = config(tmp_path, procs, list(range(len(argvs))))
    cfg["on_failure"] = "continue"
    p = start(tmp_path, cfg, host_path(tmp_path, spawn))
    try:
        p.wait(30)
        doc = state(cfg)
        assert [(r["exit_code"], r["signal"]) for r in doc["ranks"]] == [(0, None)] + [(127, None)] * 6 + [(0, None)], doc
        logs = [(Path(cfg["rundir"]) / "a1" / "1" / f"rank.{r}" / "stdout").read_text() for r in range(len(argvs))]
        here, sigign, fds, sid, pid = logs[0].splitlines()
        assert here == str(cwd)
        assert not int(sigign.split()[1], 16) & (1 << (signal.SIGPIPE - 1)), sigign
        assert set(fds.split()) <= {"0", "1", "2", "3"}, fds   # 3: ls's own listing
        assert sid.strip() == pid.split()[1], (sid, pid)   # a session of its own
        assert logs[1:7] == [f"orch: cannot start {name}: {why}\n" for name, why in (
            ("no-such-program", "No such file or directory"), ("/no/such/program", "No such file or directory"),
            ("./not-executable", "Permission denied"), ("on-path", "Permission denied"),
            ("./bad-interpreter", "No such file or directory"), ("./no-shebang", "Exec format error"))], logs
        assert logs[7] == "script ok\n", logs[7]
        spawned(cfg, spawn)
    finally:
        p.kill()
        p.wait()


def test_an_exception_in_the_supervisor_stops_its_ranks_and_names_the_error(tmp_path):
    """Any unexpected exception in the loop: this host's ranks are stopped (TERM, then KILL) and the
    final state names the error and where the traceback is."""
    bad = rank_proc(1, ["sleep", "300"], env={"X": 5})   # not a string: starting it raises
    cfg = config(tmp_path, [rank_proc(0, ["sh", "-c", "trap '' TERM; sleep 300"]), bad], [0, 1])
    p = start(tmp_path, cfg)
    try:
        rc = p.wait(30)
        out = p.stdout.read().decode()
        assert rc == 1 and out.startswith("ok "), out
        doc = state(cfg)
        assert doc["state"] == "failed", doc
        assert "the run's supervisor on h1 crashed (AttributeError" in doc["message"]
        assert "agent.log" in doc["message"]
        pid = doc["ranks"][0]["pid"]
        assert pid and not alive(pid)   # it ignored TERM: KILLed after the grace
        assert [r["state"] for r in doc["ranks"]] == ["stopped", "stopped"]
        log = (Path(cfg["rundir"]) / "agent.log").read_text()
        assert "Traceback" in log and "AttributeError" in log
    finally:
        p.kill()
        p.wait()


def test_what_the_supervisor_writes_is_the_users_alone(tmp_path):
    cfg = config(tmp_path, [rank_proc(0, ["sh", "-c", "umask; echo hi > mine.txt; ls -l mine.txt"])], [0])
    cfg["procs"][0]["cwd"] = str(tmp_path)
    old = os.umask(0o027)
    try:
        p = start(tmp_path, cfg)
    finally:
        os.umask(old)
    try:
        p.wait(30)
        wd = Path(cfg["workdir"])
        assert oct((wd / ".orch").stat().st_mode & 0o777) == "0o700"
        assert oct(Path(cfg["rundir"]).stat().st_mode & 0o777) == "0o700"
        assert oct((wd / ".orch" / "lock").stat().st_mode & 0o777) == "0o600"
        assert oct((Path(cfg["rundir"]) / "agent.json").stat().st_mode & 0o777) == "0o600"
        # the rank runs with the user's own umask (here 027), nothing forced
        out = (Path(cfg["rundir"]) / "a1" / "1" / "rank.0" / "stdout").read_text()
        assert out.splitlines()[0] == "0027", out
        assert (tmp_path / "mine.txt").stat().st_mode & 0o777 == 0o640
    finally:
        p.kill()
        p.wait()


def test_a_planted_orch_dir_is_refused_with_one_line(tmp_path):
    wd = tmp_path / "wd"
    wd.mkdir()
    os.symlink("/tmp", wd / ".orch")
    cfg = config(tmp_path, [], [])
    rundir = Path(cfg["rundir"])
    install_agent(tmp_path / "agentdir")
    res = subprocess.run([PY, "-S", str(tmp_path / "agentdir" / "agent.py"), "start", str(rundir), "--foreground"],
                         input=json.dumps(cfg).encode(), capture_output=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 1 and b"not a directory (a link?)" in res.stderr and b"Traceback" not in res.stderr
    assert not (rundir / "agent.json").exists()


@pytest.mark.parametrize("mode", [0o755, 0o777])
def test_an_existing_orch_dir_is_made_private(tmp_path, mode):
    from orchestrator.agent import cli

    d = tmp_path / ".orch"
    d.mkdir()
    d.chmod(mode)
    cli.private_dir(str(d))
    assert d.stat().st_mode & 0o777 == 0o700


def test_a_member_whose_head_falls_silent_stops_its_own_ranks(tmp_path):
    """A link cut leaves the TCP connection open and silent, no FIN: the cut-off host's supervisor
    stops its own ranks once it has heard nothing from the head for lost_after (4 s here: the head
    says something every second, a loaded machine included), and records them lost (README: "the cut-off host's supervisor stops its own ranks"). The head runs in this
    process and is frozen, as a cut link would leave it; the member is agent.py, as on a host."""
    import threading

    from orchestrator.agent import server as S

    all_ranks = [{"rank": 0, "host": "h2", "device": 0, "pid": None, "state": "pending", "exit_code": None,
                  "signal": None, "start": None, "end": None, "attempt": 0}]
    (tmp_path / "head").mkdir(mode=0o700)
    head_cfg = {"run_id": "R1", "host": "h1", "role": "head", "token": "ab" * 16, "rundir": str(tmp_path / "head"),
                "workdir": str(tmp_path), "log_link": str(tmp_path / "log_output"), "launcher": "ranktable",
                "on_failure": "stop", "restarts": 0, "grace": 1, "lost_after": 60, "join_timeout": 60, "ranks": [],
                "procs": [], "hosts": ["h1", "h2"], "all_ranks": all_ranks}
    listeners, port, advertised = S.listen(["127.0.0.1"], True)
    head = S.Supervisor(head_cfg, listeners, None, advertised)
    frozen, errors = threading.Event(), []

    def serve():
        try:
            while not frozen.is_set():
                head.io(0.02)
                head.head_tick(False)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    (tmp_path / "m").mkdir()
    cfg = config(tmp_path / "m", [rank_proc(0, ["sleep", "300"])], [0])
    cfg.update(host="h2", role="member", head_port=port, head_addresses=["127.0.0.1"], lost_after=4,
               hosts=["h1", "h2"], all_ranks=all_ranks)
    p = start(tmp_path / "m", cfg)
    try:
        wait(lambda: bool(state(cfg).get("ranks")) and all(r.get("pid") for r in state(cfg)["ranks"]), 30)
        pid = state(cfg)["ranks"][0]["pid"]
        assert alive(pid) and head.head.doc["state"] == "running" and not errors
        frozen.set()                    # the head says nothing more; its connection stays open
        thread.join(5)
        assert p.wait(60) == 0
        doc = state(cfg)
        assert not alive(pid)
        assert doc["state"] == "lost" and doc["ranks"][0]["state"] == "lost", doc
        assert doc["stopping"] == "lost contact with the launch host", doc
    finally:
        frozen.set()
        p.kill()
        p.wait()
        for c in list(head.conns):
            c.close()
        for s in head.listeners:
            s.close()
