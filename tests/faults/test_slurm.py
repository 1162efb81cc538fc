"""The same cluster.yaml on Slurm (`inventory.slurm`), against the lab's real slurmctld and
slurmd (`orch lab up N --slurm`): allocation, preflight, rank tables from each node's
hccn.conf, mpirun inside the allocation, fail-fast, detach + status + down, refusals in
Slurm's words, Ctrl-C while queued. After every test, nothing is left in the queue or on
the nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support import host_procs, leftovers, orch, run_record, running, spawn_orch, wait_until

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def sl(lab_factory):
    return lab_factory("q", 2, slurm=True)


def slurm_cmd(lab, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30,
                          env={**os.environ, "SLURM_CONF": lab.slurm_conf})


def queue(lab) -> list[str]:
    """`squeue`: 'ID NAME STATE' of every job the lab's Slurm has not finished."""
    res = slurm_cmd(lab, "squeue", "-h", "-o", "%i %j %T")
    assert res.returncode == 0, res.stderr
    return res.stdout.split("\n")[:-1]


def job_state(lab, job_id: str) -> str:
    out = slurm_cmd(lab, "scontrol", "show", "job", "-o", job_id).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else ""


def cluster(lab, tmp_path: Path, command, *, slots: int = 2, slurm: dict | None = None, name="cluster.yaml",
            **job) -> Path:
    inv = yaml.safe_load(lab.slurm_inventory_path.read_text())
    inv["defaults"]["slots"] = slots
    inv["slurm"].update(slurm or {})
    doc = {"inventory": inv, "ssh": {"connect_timeout": 3, "command_timeout": 30, "retries": 2},
           "job": {"workdir": "/data/sl", "command": command, **job}, "checks": {"versions": ["python"]}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(autouse=True)
def nothing_left(sl):
    yield
    assert wait_until(lambda: queue(sl) == [], timeout=15), queue(sl)


def test_ranktable_ascend_2x8_each_rank_gets_its_nodes_device_ip(sl, tmp_path):
    """ranktable (ascend) on 2 Slurm nodes x 8: each rank's DEVICE_ID/RANK_ID and its own
    device_ip, read from the hccn.conf of the node it landed on; the job is released."""
    show = ("import json, os; t = json.load(open(os.environ['RANK_TABLE_FILE'])); "
            "me = [(s['server_id'], d) for s in t['server_list'] for d in s['device'] "
            "if d['rank_id'] == os.environ['RANK_ID']][0]; "
            "print(os.uname().nodename, os.environ['RANK_ID'], os.environ['DEVICE_ID'], me[0], me[1]['device_ip'])")
    cluster(sl, tmp_path, ["python3", "-c", show], slots=8, launcher="ranktable", platform="ascend",
            workdir="/data/sl-asc")
    res = orch("up", "-q", cwd=tmp_path, check_rc=0)
    rec = run_record(tmp_path)
    job = rec["slurm"]["job_id"]
    assert job_state(sl, job) == "COMPLETED", res.stderr.decode()
    for rank in range(16):
        line = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode().split()
        node, dev = 1 + rank // 8, rank % 8
        host = sl.host(node)
        hccn = dict(x.split("=", 1) for x in (sl.host_dir(node) / "hccn.conf").read_text().split())
        assert line == [host.name, str(rank), str(dev), host.address, hccn[f"address_{dev}"]], (rank, line)
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert st["state"] == "succeeded" and st["slurm"] == {"job_id": job, "state": "COMPLETED", "reason": ""}


def test_mpirun_2x2_inside_the_allocation_with_slurm_commands_on_a_login_host(sl, tmp_path):
    """mpirun 2 x 2 through Slurm, Slurm's commands run over ssh on a login host: ranks 0-1
    on the first node, 2-3 on the second, every rank's output gathered, the allocation
    released by itself."""
    cluster(sl, tmp_path, ["sh", "-c", 'echo "$(hostname) $OMPI_COMM_WORLD_RANK of $OMPI_COMM_WORLD_SIZE"'],
            launcher="mpirun", workdir="/data/sl-mpi", slurm={"login": sl.host(1).address})
    orch("up", "-q", cwd=tmp_path, check_rc=0)
    for rank in range(4):
        out = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode()
        assert out == f"{sl.host(1 + rank // 2).name} {rank} of 4\n"
    assert job_state(sl, run_record(tmp_path)["slurm"]["job_id"]) == "COMPLETED"


def test_runs_in_a_row_success_and_failure_each_reported_and_released(sl, tmp_path):
    """Five runs each of success and of rank 2 failing: exit 0 / exit 1 naming rank 2 and its
    node every time; the failing runs stop the other ranks at once (fail-fast), nothing is
    left on the nodes and Slurm's queue is empty after each."""
    ok = ["sh", "-c", "echo hi $RANK_ID"]
    bad = ["sh", "-c", 'if [ "$RANK_ID" = 2 ]; then echo boom; exit 3; fi; sleep 60']
    for command, rc in ((ok, 0), (bad, 1)):
        cluster(sl, tmp_path, command, launcher="ranktable", workdir="/data/sl-loop")
        for i in range(5):
            res = orch("up", "-q", cwd=tmp_path)
            err = res.stderr.decode()
            assert res.returncode == rc, (i, err)
            rec = run_record(tmp_path)
            if rc:  # fail-fast: the sleeping ranks were stopped, not left to end by themselves
                assert f"rank 2 on {sl.host(2).name}" in err and "exit code 3" in err, err
                st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=1).stdout)
                assert {r["state"] for r in st["ranks"] if r["rank"] != 2} == {"stopped"}, st["ranks"]
            run_id = rec["id"]
            assert queue(sl) == [], (i, queue(sl))
            assert leftovers(run_id) == [], i


def test_detached_run_survives_the_controller_and_down_empties_the_queue(sl, tmp_path):
    """`orch up` killed (SIGKILL) after the launch: the run goes on inside its Slurm job;
    `orch status` from a fresh process shows it running with the Slurm job id and state;
    `orch down` stops it, and then squeue is empty and nothing of the run is left."""
    cluster(sl, tmp_path, ["sh", "-c", "echo up $RANK_ID; sleep 120"], launcher="ranktable", workdir="/data/sl-det")
    proc = spawn_orch("up", cwd=tmp_path)
    try:
        assert wait_until(lambda: running(tmp_path), timeout=60)
        assert wait_until(lambda: orch("logs", "--rank", 3, cwd=tmp_path).stdout == b"up 3\n", timeout=30)
    finally:
        proc.kill()
        proc.wait()
    rec = run_record(tmp_path)
    run_id, job = rec["id"], rec["slurm"]["job_id"]
    time.sleep(1)
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert st["state"] == "running" and st["slurm"]["job_id"] == job and st["slurm"]["state"] == "RUNNING"
    assert [r["state"] for r in st["ranks"]] == ["running"] * 4
    assert any(line.startswith(f"{job} ") for line in queue(sl))
    orch("down", cwd=tmp_path, check_rc=0)
    assert queue(sl) == []
    assert leftovers(run_id) == [] and host_procs(sl, 1, run_id) == [] and host_procs(sl, 2, run_id) == []
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=4).stdout)
    assert st["state"] == "stopped"


def test_a_partition_that_does_not_exist_is_one_clear_error(sl, tmp_path):
    cluster(sl, tmp_path, "true", slurm={"partition": "nosuch"})
    res = orch("up", cwd=tmp_path, check_rc=3)
    err = res.stderr.decode()
    assert "no partition 'nosuch'" in err and "Traceback" not in err, err
    assert not (tmp_path / ".orch" / "runs").exists() or not list((tmp_path / ".orch" / "runs").iterdir())


def test_more_nodes_than_the_partition_has_fails_instead_of_waiting(sl, tmp_path):
    cluster(sl, tmp_path, "true", slurm={"nodes": 5})
    res = orch("up", cwd=tmp_path, timeout=60, check_rc=3)
    assert "cannot start" in res.stderr.decode() and "was cancelled" in res.stderr.decode(), res.stderr


def test_ctrl_c_while_queued_cancels_the_request(sl, tmp_path):
    """Every CPU of both nodes held by another job: `orch up` waits in the queue, saying so;
    Ctrl-C cancels its request (exit 130) and leaves the other job alone."""
    blocker = slurm_cmd(sl, "sbatch", "--parsable", "-N2", "--ntasks-per-node=16", "--output=/dev/null",
                        "--wrap", "sleep 300").stdout.strip()
    try:
        cluster(sl, tmp_path, "true", launcher="ranktable")
        proc = spawn_orch("up", cwd=tmp_path)
        assert wait_until(lambda: any(" orch-" in line and "PENDING" in line for line in queue(sl)), timeout=30)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert b"is pending" in err and b"request was cancelled" in err, err
        assert [line.split()[0] for line in queue(sl)] == [blocker]
    finally:
        slurm_cmd(sl, "scancel", blocker)


def test_the_slurm_time_limit_ends_the_run_timeout(sl, tmp_path):
    """`time: "1"` (a minute) on a job that sleeps: Slurm ends it at its time limit (its SIGTERM
    reaches the supervisors as a stop); orch says `timeout` in Slurm's words, exit 1, and
    `orch status` agrees; nothing is left."""
    cluster(sl, tmp_path, ["sh", "-c", "echo up $RANK_ID; sleep 600"], launcher="ranktable",
            workdir="/data/sl-time", slurm={"time": "1"})
    res = orch("up", "-q", cwd=tmp_path, timeout=240, check_rc=1)
    err = res.stderr.decode()
    assert "timeout: Slurm job" in err and "ended TIMEOUT: its time limit was reached" in err, err
    rec = run_record(tmp_path)
    assert rec["state"] == "timeout" and leftovers(rec["id"]) == []
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=1).stdout)
    assert st["state"] == "timeout" and st["slurm"]["state"] == "TIMEOUT"


@pytest.mark.parametrize("playbook, launcher", [("mindspore-msrun", "msrun"), ("torch-ddp", "torchrun")])
def test_training_playbooks_train_through_slurm(sl, tmp_path, playbook, launcher):
    """The MindSpore (msrun) and PyTorch DDP (torchrun) playbooks, 2 nodes x 2 workers, on a
    Slurm inventory, unchanged but for their inventory: every rank trains and ends with the
    same weights, each on the node the plan put it on."""
    venv = Path(os.environ.get("ORCH_TRAIN_VENV", "/opt/orch-venvs/train"))
    if not (venv / "bin" / launcher).exists():
        pytest.fail(f"{launcher} not in {venv}/bin: run `bash scripts/install-e2e-deps.sh` (scripts/test.sh does)")
    src = Path(__file__).resolve().parents[2] / "playbooks" / playbook
    doc = yaml.safe_load((src / "cluster.yaml").read_text())
    assert doc["job"]["launcher"] == launcher
    doc["inventory"] = str(sl.slurm_inventory_path)
    doc["job"]["sync"] = [str(src / s) for s in doc["job"]["sync"]]
    doc["job"]["env"]["EPOCHS"] = "1"
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    orch("up", "-q", cwd=tmp_path, timeout=300, check_rc=0)
    sums = set()
    for rank in range(4):
        out = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode()
        assert re.search(r"^epoch: 0, step: \d+, loss is [0-9.]+$", out, re.M), out[-2000:]
        m = re.search(rf"^rank {rank}/4 on (\S+): weights checksum ([0-9a-f]{{16}})$", out, re.M)
        assert m and m.group(1) == sl.host(1 + rank // 2).name, out[-2000:]
        sums.add(m.group(2))
    assert len(sums) == 1


def test_check_allocates_briefly_or_uses_a_held_job_and_plan_touches_nothing(sl, tmp_path):
    """`orch check` on a Slurm inventory checks the nodes of a brief allocation it releases;
    with --slurm-job, the nodes of a job the user holds (left running); `orch plan` shows
    the sbatch and srun commands and submits nothing."""
    cluster(sl, tmp_path, "true", launcher="ranktable", workdir="/data/sl-chk")
    doc = json.loads(orch("check", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert {r["host"] for r in doc["results"] if r["host"]} == {sl.host(1).name, sl.host(2).name}
    assert queue(sl) == []
    held = slurm_cmd(sl, "sbatch", "--parsable", "-N2", "--output=/dev/null", "--wrap", "sleep 120").stdout.strip()
    try:
        assert wait_until(lambda: job_state(sl, held) == "RUNNING", timeout=30)
        doc = json.loads(orch("check", "--json", "--slurm-job", held, cwd=tmp_path, check_rc=0).stdout)
        assert {r["host"] for r in doc["results"] if r["host"]} == {sl.host(1).name, sl.host(2).name}
        assert job_state(sl, held) == "RUNNING"
    finally:
        slurm_cmd(sl, "scancel", held)
    assert wait_until(lambda: queue(sl) == [], timeout=15)
    out = orch("plan", cwd=tmp_path, check_rc=0).stdout.decode()
    assert "allocate: sbatch --parsable --job-name=orch-" in out and "head step: srun --overlap" in out, out
    assert queue(sl) == []
