"""MsrunLauncher: every msrun worker records its own exit code (msrun reports one per host)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.launch import MsrunLauncher
from orchestrator.plan import make_plan
from orchestrator.render import msrun_argv
from orchestrator.spec import Cluster, Host, Job


def cluster(command, n_hosts=2, slots=2) -> Cluster:
    hosts = tuple(Host(name=f"h{i}", address=f"10.0.0.{i}", user="root", slots=slots, devices=tuple(range(slots)))
                  for i in range(1, n_hosts + 1))
    return Cluster(name="t", path=Path("/tmp/cluster.yaml"), hosts=hosts,
                   job=Job(workdir="/data/job", command=tuple(command), launcher="msrun", platform="cpu"))


def launcher(command) -> MsrunLauncher:
    c = cluster(command)
    return MsrunLauncher(c, make_plan(c), "RUN1", {})


@pytest.mark.parametrize("command,starter,interp,script", [
    (["python", "train.py", "--lr", "1"], "python", "python", ["train.py", "--lr", "1"]),
    (["python3", "train.py"], "python3", "python3", ["train.py"]),
    (["/usr/bin/python3.11", "x/net.py"], "python3", "/usr/bin/python3.11", ["x/net.py"]),
    (["train.py"], "python", "python", ["train.py"]),  # msrun's own default interpreter
])
def test_task_wraps_the_script_and_keeps_its_interpreter(command, starter, interp, script):
    task = launcher(command).task()
    assert task[0] == starter and task[1] == "-c" and task[3:] == [interp, *script]


def test_specs_one_msrun_per_host_with_the_wrapped_task():
    lc = launcher(["python", "train.py", "a"])
    specs = lc.specs()
    assert list(specs) == ["h1", "h2"]
    for name, [(key, rank, spec)] in specs.items():
        plain = msrun_argv(lc.cluster, lc.plan, name)
        assert key == f"msrun.{name}" and rank is None
        assert spec.command[:len(plain) - 2] == plain[:-2]  # every msrun option as rendered
        assert spec.command[len(plain) - 2:] == lc.task()


def run_task(tmp_path, env, inner):
    """Run the wrapper as msrun would, with `inner` in place of `interpreter script args`."""
    lc = launcher(["python3", "train.py"])
    task = lc.task()
    return subprocess.run(["python3", task[1], task[2], *inner], env={"PATH": "/usr/bin:/bin",
                          "ORCH_RC_DIR": str(tmp_path), **env}, capture_output=True, text=True, timeout=30)


def test_worker_writes_its_rank_exit_code(tmp_path):
    res = run_task(tmp_path, {"RANK_ID": "5", "MS_ROLE": "MS_WORKER"}, ["sh", "-c", "echo hi $0 $1; exit 7", "a", "b"])
    assert res.returncode == 7 and res.stdout == "hi a b\n"
    assert (tmp_path / "rank.5.rc").read_text() == "7\n"
    assert not list(tmp_path.glob("*.tmp"))


def test_scheduler_and_unnumbered_workers_write_nothing(tmp_path):
    assert run_task(tmp_path, {"RANK_ID": "0", "MS_ROLE": "MS_SCHED"}, ["sh", "-c", "exit 3"]).returncode == 3
    assert run_task(tmp_path, {"MS_ROLE": "MS_WORKER"}, ["sh", "-c", "exit 0"]).returncode == 0
    assert list(tmp_path.iterdir()) == []

