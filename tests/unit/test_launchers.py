"""Launchers (pure) and the rank wrapper every mpirun/msrun rank runs under (agent.py rank)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from orchestrator import launchers
from orchestrator.rankplan import make_plan
from orchestrator.launchers.msrun import msrun_argv
from orchestrator.spec import Cluster, Host, Job



def install_agent(rdir: Path) -> Path:
    """The hosts' supervisor as orch ships it into a run directory: agent.py and its package."""
    from orchestrator import supervisor

    pkg = rdir / supervisor.AGENT_MODULE
    pkg.mkdir(parents=True, exist_ok=True)
    for name, src in supervisor.agent_sources().items():
        (pkg / name).write_text(src)
    (rdir / "agent.py").write_text(supervisor.agent_stub(str(rdir)))
    return rdir / "agent.py"


def cluster(command, launcher="msrun", n_hosts=2, slots=2, **job) -> Cluster:
    hosts = tuple(Host(name=f"h{i}", address=f"10.0.0.{i}", user="root", slots=slots, devices=tuple(range(slots)))
                  for i in range(1, n_hosts + 1))
    return Cluster(name="t", path=Path("/tmp/cluster.yaml"), hosts=hosts,
                   job=Job(workdir="/data/job", command=tuple(command), launcher=launcher, platform="cpu", **job))


@pytest.mark.parametrize("command,starter,interp,script", [
    (["python", "train.py", "--lr", "1"], "python", "python", ["train.py", "--lr", "1"]),
    (["python3", "train.py"], "python3", "python3", ["train.py"]),
    (["/usr/bin/python3.11", "x/net.py"], "python3", "/usr/bin/python3.11", ["x/net.py"]),
    (["train.py"], "python", "python", ["train.py"]),  # msrun's own default interpreter
])
def test_msrun_task_wraps_the_script_and_keeps_its_interpreter(command, starter, interp, script):
    task = launchers.msrun_task(command)
    assert task[0] == starter and task[1] == "-c" and task[3:] == [interp, *script]


def test_msrun_one_per_host_with_the_wrapped_task_and_the_attempt_log_dir():
    c = cluster(["python", "train.py", "a"])
    plan = make_plan(c)
    launch = launchers.build(c, plan, "RUN1", root={})
    assert list(launch.procs) == ["h1", "h2"]
    for name, [proc] in launch.procs.items():
        plain = msrun_argv(c, plan, name, log_dir=launchers.ATTEMPT_DIR, master_addr=launchers.HEAD_ADDR)
        assert proc.key == f"msrun.{name}" and proc.rank is None and proc.log == "msrun.log"
        assert list(proc.argv[:len(plain) - 2]) == plain[:-2]  # every msrun option as rendered
        assert list(proc.argv[len(plain) - 2:]) == launchers.msrun_task(c.job.command)


def test_mpirun_one_process_on_the_launch_host_ranks_wrapped_run_vars_passed():
    c = cluster(["python3", "x.py"], launcher="mpirun")
    launch = launchers.build(c, make_plan(c), "RUN1", root={"h1": True})
    assert launch.procs["h2"] == ()
    [proc] = launch.procs["h1"]
    argv = list(proc.argv)
    assert argv[0] == "mpirun" and "--allow-run-as-root" in argv
    assert argv[argv.index("--output-filename") + 1] == launchers.ATTEMPT_DIR
    for var in (launchers.RUN_VAR, launchers.DIR_VAR, launchers.ATTEMPT_VAR):
        assert argv[argv.index(var) - 1] == "-x"
    assert argv[-7:] == ["python3", "-S", "/data/job/.orch/RUN1/agent.py", "rank", "--", "python3", "x.py"]
    assert launch.files["h1"]["hostfile"].startswith(b"# orch")


def test_ranktable_every_rank_a_process_of_its_host_with_its_env_and_log():
    c = cluster(["python3", "x.py"], launcher="ranktable", stall_timeout=30)
    launch = launchers.build(c, make_plan(c), "RUN1", root={})
    p3 = launch.procs["h2"][1]
    assert (p3.key, p3.rank, p3.log, p3.env_log) == ("rank.3", 3, "1/rank.3/stdout", True)
    assert p3.env["RANK_ID"] == "3" and p3.env["RANK_SIZE"] == "4" and p3.env["MASTER_ADDR"] == launchers.HEAD_ADDR
    assert p3.env["PYTHONFAULTHANDLER"] == "1"  # stall_timeout: stacks on SIGABRT
    assert "RANK_TABLE_FILE" not in p3.env      # cpu: no rank table


def run_rank(tmp_path, env, inner, cwd=None):
    """Run a rank under the wrapper as mpirun, msrun or torchrun would."""
    install_agent(tmp_path)
    (tmp_path / "a1").mkdir(exist_ok=True)
    return subprocess.run(["python3", str(tmp_path / "agent.py"), "rank", "--", *inner], cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "ORCH_RUN_DIR": str(tmp_path), "ORCH_ATTEMPT": "1", **env},
                          capture_output=True, text=True, timeout=30)


def test_wrapper_records_the_ranks_exit_code_and_pid(tmp_path):
    res = run_rank(tmp_path, {"RANK_ID": "5"}, ["sh", "-c", "echo hi $0 $1; exit 7", "a", "b"])
    assert res.returncode == 7 and res.stdout == "hi a b\n"
    ex = json.loads((tmp_path / "a1" / "rank.5.exit").read_text())
    assert ex["exit_code"] == 7 and ex["signal"] is None
    assert json.loads((tmp_path / "a1" / "rank.5.pid").read_text())["pid"] > 0
    assert not list((tmp_path / "a1").glob("*.tmp"))


def test_wrapper_tells_a_signal_from_an_exit_code(tmp_path):
    res = run_rank(tmp_path, {"OMPI_COMM_WORLD_RANK": "2"}, ["sh", "-c", "kill -9 $$"])
    assert res.returncode == -9  # the wrapper dies of the same signal, as mpirun expects
    ex = json.loads((tmp_path / "a1" / "rank.2.exit").read_text())
    assert ex["signal"] == 9 and ex["exit_code"] is None
    res = run_rank(tmp_path, {"OMPI_COMM_WORLD_RANK": "3"}, ["sh", "-c", "exit 137"])
    ex = json.loads((tmp_path / "a1" / "rank.3.exit").read_text())
    assert res.returncode == 137 and ex["exit_code"] == 137 and ex["signal"] is None


def test_wrapper_starts_light_importing_no_part_of_the_supervisor(tmp_path):
    """mpirun starts every rank's wrapper at once (128 at 64 hosts x 2): `agent.py rank` imports
    rank.py alone, not the supervisor nor the heavy standard modules (subprocess, json, enum)."""
    install_agent(tmp_path)
    (tmp_path / "a1").mkdir()
    res = subprocess.run(["python3", "-S", "-X", "importtime", str(tmp_path / "agent.py"), "rank", "--", "true"],
                         env={"PATH": "/usr/bin:/bin", "ORCH_RUN_DIR": str(tmp_path), "ORCH_ATTEMPT": "1",
                              "OMPI_COMM_WORLD_RANK": "0"}, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines() if line.count("|") == 2}
    assert "orch_agent.rank" in imported
    assert not imported & {"orch_agent.cli", "orch_agent.server", "orch_agent.procs", "subprocess", "json",
                           "enum", "threading", "selectors"}, sorted(imported)
    assert json.loads((tmp_path / "a1" / "rank.0.exit").read_text())["exit_code"] == 0


def test_wrapper_gives_the_rank_default_signals_no_stray_descriptors_and_says_what_cannot_start(tmp_path):
    """The rank gets SIGPIPE's default action (python ignores it), none of the descriptors the
    launcher left open beyond 0-2, and a command that cannot start is exit code 127, said."""
    import os

    r, w = os.pipe()
    os.set_inheritable(w, True)
    try:
        install_agent(tmp_path)
        (tmp_path / "a1").mkdir()
        res = subprocess.run(["python3", str(tmp_path / "agent.py"), "rank", "--", "sh", "-c",
                              "grep SigIgn /proc/self/status; ls /proc/self/fd"], pass_fds=(w,),
                             env={"PATH": "/usr/bin:/bin", "ORCH_RUN_DIR": str(tmp_path), "ORCH_ATTEMPT": "1",
                                  "RANK_ID": "1"}, capture_output=True, text=True, timeout=30)
    finally:
        os.close(r)
        os.close(w)
    ignored = int(res.stdout.split()[1], 16)
    assert not ignored & (1 << (13 - 1)), res.stdout   # SIGPIPE (13) not ignored
    assert str(w) not in res.stdout.split()[2:] or w <= 3, res.stdout
    res = run_rank(tmp_path, {"RANK_ID": "2"}, ["/no/such/program", "x"])
    assert res.returncode == 127 and "orch: cannot start /no/such/program: No such file or directory" in res.stderr
    assert json.loads((tmp_path / "a1" / "rank.2.exit").read_text())["exit_code"] == 127


def test_msrun_scheduler_runs_unwrapped(tmp_path):
    install_agent(tmp_path)
    task = launchers.msrun_task(["python3", "train.py"])
    env = {"PATH": "/usr/bin:/bin", "ORCH_RUN_DIR": str(tmp_path), "ORCH_ATTEMPT": "1"}
    sched = subprocess.run(["python3", task[1], task[2], "sh", "-c", "exit 3"], env={**env, "RANK_ID": "0",
                           "MS_ROLE": "MS_SCHED"}, capture_output=True, timeout=30)
    assert sched.returncode == 3 and not (tmp_path / "a1").exists()
    (tmp_path / "a1").mkdir()
    worker = subprocess.run(["python3", task[1], task[2], "sh", "-c", "exit 4"], env={**env, "RANK_ID": "1",
                            "MS_ROLE": "MS_WORKER"}, capture_output=True, timeout=30)
    assert worker.returncode == 4 and json.loads((tmp_path / "a1" / "rank.1.exit").read_text())["exit_code"] == 4


def test_torchrun_one_per_host_static_rendezvous_wrapped_workers():
    c = cluster(["python", "train.py", "--lr", "1"], launcher="torchrun", master_port=29500)
    plan = make_plan(c)
    launch = launchers.build(c, plan, "RID", root={})
    [p1], [p2] = launch.procs["h1"], launch.procs["h2"]
    assert p2.argv == ("torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1",
                       f"--master-addr={launchers.HEAD_ADDR}",
                       "--master-port=29500", "--max-restarts=0", "--no-python",
                       "python3", "-S", "/data/job/.orch/RID/agent.py", "rank", "--", "python", "train.py", "--lr", "1")
    assert p1.key == "torchrun.h1" and p1.log == "torchrun.log" and p1.env["ORCH_RANK_OUTPUT"] == "1"


def test_torchrun_needs_the_same_slots_everywhere():
    from dataclasses import replace

    from orchestrator.errors import PlanError
    c = cluster(["python", "t.py"], launcher="torchrun")
    c = replace(c, hosts=(c.hosts[0], replace(c.hosts[1], slots=1, devices=(0,))))
    with pytest.raises(PlanError, match="torchrun rule"):
        make_plan(c)


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable", "msrun", "torchrun"])
def test_hccl_timeouts_and_rank_dirs_reach_every_rank(launcher):
    """Ascend: HCCL_CONNECT_TIMEOUT grows with the cluster (at least HCCL's 120 s) or is job.hccl's;
    job.env wins; rank_dirs is passed to whatever starts the ranks."""
    from orchestrator.hccl import hccl_connect_timeout

    c = cluster(["python", "t.py"], launcher=launcher, n_hosts=2, rank_dirs=True, hccl_exec_timeout=900)
    from orchestrator.spec import Checks
    c = Cluster(name=c.name, path=c.path, hosts=c.hosts, job=Job(**{**c.job.__dict__, "platform": "ascend"}),
                checks=Checks(skip=("device-rules",)))  # 2 devices a host: not HCCL's rule, fine here
    launch = launchers.build(c, make_plan(c), "RID", root={}, device_ips={
        h.name: {0: "192.168.1.1", 1: "192.168.1.2"} for h in c.hosts})
    for procs in launch.procs.values():
        for p in procs:
            env = dict(p.env)
            if launcher == "mpirun":
                env.update(a.split("=", 1) for a in p.argv if "=" in a and a.split("=", 1)[0].isupper())
            assert (env["HCCL_CONNECT_TIMEOUT"], env["HCCL_EXEC_TIMEOUT"], env["ORCH_RANK_DIRS"]) == \
                ("120", "900", "1"), (launcher, p)
    assert hccl_connect_timeout(c, 2) == 120 and hccl_connect_timeout(c, 64) == 256
    assert hccl_connect_timeout(c, 5000) == 7200
    c = Cluster(name=c.name, path=c.path, hosts=c.hosts, checks=c.checks,
                job=Job(**{**c.job.__dict__, "hccl_connect_timeout": 600, "env": {"HCCL_EXEC_TIMEOUT": "5"}}))
    env = dict(launchers.build(c, make_plan(c), "RID", root={}, device_ips={
        h.name: {0: "192.168.1.1", 1: "192.168.1.2"} for h in c.hosts}).procs["h1"][0].env)
    if launcher != "mpirun":
        assert (env["HCCL_CONNECT_TIMEOUT"], env["HCCL_EXEC_TIMEOUT"]) == ("600", "5")


def test_wrapper_keeps_a_torchrun_ranks_output_and_enters_its_rank_dir(tmp_path):
    """ORCH_RANK_OUTPUT: the rank's output goes to a1/1/rank.N/stdout (mpirun's layout, which
    orch logs reads); ORCH_RANK_DIRS: it runs in workdir/rank_N, the workdir's entries linked."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "data.txt").write_text("shared\n")
    res = run_rank(tmp_path, {"RANK": "3", "ORCH_RANK_OUTPUT": "1", "ORCH_RANK_DIRS": "1"},
                   ["sh", "-c", "pwd; cat data.txt; echo mine > out.txt; echo err >&2; exit 2"], cwd=work)
    assert res.returncode == 2 and res.stdout == ""
    assert (tmp_path / "a1" / "1" / "rank.3" / "stdout").read_text() == f"{work}/rank_3\nshared\nerr\n"
    assert (work / "rank_3" / "out.txt").read_text() == "mine\n" and not (work / "out.txt").exists()
    assert (work / "rank_3" / "data.txt").is_symlink()
    assert json.loads((tmp_path / "a1" / "rank.3.exit").read_text())["exit_code"] == 2


@pytest.mark.parametrize("safe_path", [False, True])
def test_the_hosts_supervisor_is_byte_code_cached(tmp_path, safe_path):
    """agent.py on a host is a stub importing the orch_agent package, so python caches the supervisor's
    bytecode after its first start (a script run as itself is compiled on every start: each
    rank's wrapper, status, watch); the package is the workdir's, shared by runs (its bytecode
    too); it works with PYTHONSAFEPATH set too."""
    import os
    import sys

    from orchestrator import supervisor

    rdir = tmp_path / "wd" / ".orch" / "RUN1"
    # on its stdin, as the transports send it (the package is past one argument's 128 KiB limit)
    subprocess.run(["sh"], input=supervisor._write_agent(str(rdir)).encode(), check=True, timeout=30)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH")}
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    for _ in range(2):
        res = subprocess.run([sys.executable, "-S", str(rdir / "agent.py"), "status", str(rdir)], env=env,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and isinstance(json.loads(res.stdout), dict), res.stderr
    home = rdir.parent / supervisor.agent_home_name()
    cached = sorted(p.name.split(".")[0] for p in (home / "orch_agent" / "__pycache__").iterdir())
    assert {"cli", "server", "procs", "protocol", "states", "layout"} <= set(cached), cached
    assert oct((rdir).stat().st_mode & 0o777) == "0o700" and oct(rdir.parent.stat().st_mode & 0o777) == "0o700"


def test_wrapper_gives_the_rank_the_runs_secrets_from_its_supervisors_file(tmp_path):
    """mpirun: secret env values never ride on Open MPI's wire; the host's supervisor keeps them in
    a 0600 file of the run directory and `agent.py rank` hands them to the rank."""
    from orchestrator.agent import layout

    layout.write_atomic(str(tmp_path / layout.SECRETS), json.dumps({"HF_TOKEN": "s3cret"}), 0o600)
    res = run_rank(tmp_path, {"OMPI_COMM_WORLD_RANK": "1"}, ["sh", "-c", "echo \"[$HF_TOKEN]\""])
    assert res.returncode == 0 and res.stdout == "[s3cret]\n"
    assert oct((tmp_path / layout.SECRETS).stat().st_mode & 0o777) == "0o600"
    (tmp_path / layout.SECRETS).unlink()
    res = run_rank(tmp_path, {"OMPI_COMM_WORLD_RANK": "1"}, ["sh", "-c", "echo \"[$HF_TOKEN]\""])
    assert res.stdout == "[]\n"


def test_shipping_the_supervisor_quotes_every_path_and_refuses_a_planted_link(tmp_path):
    """The script that makes the run directory and writes the agent package: a workdir full of
    shell syntax runs nothing; a `.orch` that is a link is refused in one line, nothing written."""
    import os

    from orchestrator import supervisor

    wd = tmp_path / "it's $(touch pwned1) `touch pwned2` ; x & y"
    wd.mkdir()
    rdir = wd / ".orch" / "R1"
    res = subprocess.run(["sh"], input=supervisor._write_agent(str(rdir)), cwd=tmp_path, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert not list(tmp_path.glob("pwned*")) and (rdir / "agent.py").is_file()
    assert oct(rdir.stat().st_mode & 0o777) == "0o700"
    assert (rdir.parent / supervisor.agent_home_name() / "orch_agent" / "cli.py").is_file()
    other = tmp_path / "w2"
    other.mkdir()
    os.symlink(tmp_path / "elsewhere", other / ".orch")
    (tmp_path / "elsewhere").mkdir()
    res = subprocess.run(["sh"], input=supervisor._write_agent(str(other / ".orch" / "R1")), capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 1 and "is not a directory of this user" in res.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_shipping_the_supervisor_makes_its_directories_private_or_says_why_in_one_line(tmp_path):
    """One python process makes the run's directories (no mkdir/chmod/cat processes): a
    user's own `.orch` left 0755 is made 0700; one another user owns, or a workdir that cannot be
    made, is refused in one line, no traceback, no agent.py written."""
    import os

    from orchestrator import supervisor

    wd = tmp_path / "wd"
    (wd / ".orch").mkdir(parents=True)
    (wd / ".orch").chmod(0o755)
    script = supervisor._write_agent(str(wd / ".orch" / "R1"))
    assert not re.search(r"^(mkdir|chmod|cat) ", script, re.M)   # no process but the python
    res = subprocess.run(["sh"], input=script, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert oct((wd / ".orch").stat().st_mode & 0o777) == "0o700"
    assert (wd / ".orch" / "R1" / "agent.py").read_text() == supervisor.agent_stub(
        str(wd / ".orch" / supervisor.agent_home_name()))
    assert oct((wd / ".orch" / "R1" / "agent.py").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "afile").write_text("")
    res = subprocess.run(["sh"], input=supervisor._write_agent(str(tmp_path / "afile" / "wd" / ".orch" / "R1")),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and res.stderr.startswith(f"orch: cannot make {tmp_path / 'afile' / 'wd'}: ")
    assert "Traceback" not in res.stderr
    if os.getuid() == 0:   # another user's directory (as root: the lab's and CI's user)
        theirs = tmp_path / "w3" / ".orch"
        theirs.mkdir(parents=True, mode=0o700)
        os.chown(theirs, 65534, 65534)
        res = subprocess.run(["sh"], input=supervisor._write_agent(str(theirs / "R1")), capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 1 and res.stderr == (f"orch: {theirs} is not a directory of this user (a link, "
                                                       "or another user owns it)\n")
        assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("role, told", [("member", "package+conf"), ("head", "package")])
def test_a_start_told_nothing_more_starts_nothing_and_leaves_no_run_directory(tmp_path, role, told):
    """supervisor.boot: the host unpacks and waits on its stdin: a member, with its configuration,
    for the head's line; the head for its configuration (sent once the code is synced). The stdin
    ending before it (the head did not start; the sync failed) starts nothing, says so, removes the
    run directory it made (the package stays, for the next run)."""
    import os

    from orchestrator import supervisor

    rdir = tmp_path / "wd" / ".orch" / "R1"
    cfg = {"rundir": str(rdir), "run_id": "R1", "role": role, "workdir": str(tmp_path / "wd"), "head_port": None}
    b = supervisor.boot(cfg)
    assert supervisor.agent_blob() not in b.command and "R1" in b.command and b.package.endswith(b"\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    res = subprocess.run(["sh", "-c", b.command], input=b.package + (b.conf if told == "package+conf" else b""),
                         capture_output=True, timeout=60, env=env)
    assert (res.returncode, res.stdout, res.stderr) == (3, b"nohead\n", b"")
    assert sorted(p.name for p in (tmp_path / "wd" / ".orch").iterdir()) == [supervisor.agent_home_name()]


def test_a_start_left_silent_starts_nothing_and_blank_lines_keep_it_waiting(tmp_path):
    """A start's stdin that stays silent for --silence seconds (layout.START_SILENCE: 60) before
    it is told its configuration: whoever would tell it is gone; it starts nothing, says so, and
    removes the run directory it made. The blank lines the controller sends while it waits
    (lifecycle._Told) keep it waiting."""
    import os
    import time

    from orchestrator import supervisor

    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    for run_id, keepalive in (("R1", False), ("R2", True)):
        rdir = tmp_path / "wd" / ".orch" / run_id
        b = supervisor.boot({"rundir": str(rdir), "run_id": run_id, "role": "head", "workdir": str(tmp_path / "wd")})
        p = subprocess.Popen(["sh", "-c", supervisor.boot_command(b.env, [*b.args, "--silence", "2"])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert p.stdin is not None
        p.stdin.write(b.package)
        p.stdin.flush()
        if keepalive:
            for _ in range(12):   # 3.6 s, a line every 0.3: more than its silence
                time.sleep(0.3)
                p.stdin.write(b"\n")
                p.stdin.flush()
                assert p.poll() is None
        else:
            p.wait(timeout=30)   # its stdin open, silent: it ends by itself
        out, err = p.communicate(timeout=30)   # (R2: its stdin's end, nothing more said)
        assert (p.returncode, out, err) == (3, b"nohead\n", b""), run_id
        assert not rdir.exists()


@pytest.mark.parametrize("launcher,platform,names", [
    ("mpirun", "cpu", ("hostfile",)), ("ranktable", "ascend", ("rank_table.json",)),
    ("ranktable", "cpu", ()), ("msrun", "ascend", ()), ("torchrun", "gpu", ())])
def test_the_files_the_probe_lists_are_the_launchers_own_files(launcher, platform, names):
    """rendered_names (what up's probe lists for sync) are the files the launcher writes, and only those."""
    from dataclasses import replace

    c = cluster(["python3", "net.py"], launcher=launcher, n_hosts=1)
    c = replace(c, job=replace(c.job, platform=platform))
    kind = launchers.LAUNCHERS[launcher]
    assert kind.rendered_names(c) == names
    written = launchers.build(c, make_plan(c), "r1", root={}, device_ips={h.name: {d: f"10.9.0.{d + 1}" for d in h.devices}
                                                                         for h in c.hosts}).files
    assert {n for f in written.values() for n in f} == set(names)


def test_runs_share_the_workdirs_package_unpacked_once_and_whole(tmp_path):
    """The supervisor's package is the workdir's, one per version (<workdir>/.orch/agent-<hash>):
    a second run's start finds it and writes nothing there (its bytecode is kept: no compiling
    again); starts racing each other each end with the package whole, no temporary left."""
    import os
    import sys

    from orchestrator import supervisor

    wd = tmp_path / "wd"
    home = wd / ".orch" / supervisor.agent_home_name()
    subprocess.run(["sh"], input=supervisor._write_agent(str(wd / ".orch" / "R1")).encode(), check=True, timeout=30)
    marker = home / "orch_agent" / "__pycache__" / "kept"
    marker.parent.mkdir()
    marker.write_text("")
    before = {p: p.stat().st_mtime_ns for p in (home / "orch_agent").iterdir()}
    # the package's line is not even decoded: garbage in its place changes nothing
    script = supervisor._write_agent(str(wd / ".orch" / "R2")).replace(supervisor.agent_blob(), "garbage")
    subprocess.run(["sh"], input=script.encode(), check=True, timeout=30)
    assert {p: p.stat().st_mtime_ns for p in (home / "orch_agent").iterdir()} == before and marker.exists()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    res = subprocess.run([sys.executable, "-S", str(wd / ".orch" / "R2" / "agent.py"), "status", str(wd / ".orch" / "R2")],
                         env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and isinstance(json.loads(res.stdout), dict), res.stderr

    wd2 = tmp_path / "wd2"
    procs = [subprocess.Popen(["sh"], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(6)]
    for i, p in enumerate(procs):
        p.stdin.write(supervisor._write_agent(str(wd2 / ".orch" / f"R{i}")).encode())   # type: ignore[union-attr]  # a pipe
        p.stdin.close()   # type: ignore[union-attr]  # a pipe
    assert [p.wait(timeout=60) for p in procs] == [0] * 6, [p.stderr.read() for p in procs]   # type: ignore[union-attr]  # a pipe
    home2 = wd2 / ".orch" / supervisor.agent_home_name()
    assert sorted(p.name for p in (home2 / "orch_agent").iterdir()) == sorted(supervisor.agent_sources())
    assert sorted(p.name for p in (wd2 / ".orch").iterdir()) == sorted([home2.name] + [f"R{i}" for i in range(6)])


def test_a_start_sends_the_package_only_where_the_check_did_not_find_it(tmp_path):
    """The check (or prepare) says which hosts have this orch's package (AGENT_THERE): their start
    carries an empty line in its place, not its ~95 KB (127 copies of it per `orch up` at 128
    hosts). Should it be gone by the start, the start says so and starts nothing."""
    from orchestrator import prepare, supervisor

    cfg = {"rundir": "/data/w/.orch/R1", "run_id": "R1", "role": "member"}
    assert supervisor.boot(cfg).package == supervisor.agent_blob().encode() + b"\n"
    assert supervisor.boot(cfg, send=False).package == b"\n"
    # the fact, from python_sh's words on the host
    wd = tmp_path / "wd"
    home = wd / ".orch" / supervisor.agent_home_name()
    script = supervisor.python_sh(supervisor.facts_env(str(wd / ".orch" / "lock"), str(home)))
    said = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert said.returncode == 0 and prepare.parse_prepare(said.stdout)["agent"] is False
    home.mkdir(parents=True)
    said = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert said.returncode == 0 and prepare.parse_prepare(said.stdout)["agent"] is True
    # not sent, and gone since: a clear word, nothing started, no package made
    home.rmdir()
    b = supervisor.boot({**cfg, "rundir": str(wd / ".orch" / "R1")}, send=False)
    gone = subprocess.run(["sh", "-c", b.command], input=(b.package + b.conf).decode(),
                          capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0 and "is gone since the check found it there; run orch up again" in gone.stderr
    assert "Traceback" not in gone.stderr and not home.exists()
