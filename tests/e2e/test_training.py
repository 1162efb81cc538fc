"""Real distributed training, end to end, on the simulated cluster (issue 6).

Each test runs one of playbooks/* exactly as a user would after `orch lab up`: the
playbook's own cluster file, with only its inventory pointed at this test's lab (the
derived inventory made by playbooks/lab_inventory.py, as the playbook's comments say)
and its sync paths made absolute. `orch up` must exit 0, and `orch logs --rank N` must
show, for every rank, the seeds' loss lines with the last loss below the first and the
same weight checksum on every rank (the ranks really exchanged gradients).

Needs scripts/install-e2e-deps.sh to have run (MindSpore 2.10.0, mpi4py and numpy in
/opt/orch-venvs/train): without it these tests FAIL, saying so; they skip only where a
lab cannot be made (not root, no network namespaces), like every lab test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.supervisor import STOP_GRACE
from tests.support import REPO, budget, described, leftovers, orch, run_record, timed

pytestmark = pytest.mark.lab
PLAYBOOKS = REPO / "playbooks"
VENV = Path(os.environ.get("ORCH_TRAIN_VENV", "/opt/orch-venvs/train"))
LOSS = re.compile(r"^epoch: (\d+), step: (\d+), loss is ([0-9.eE+-]+)$", re.M)
CHECKSUM = re.compile(r"^rank (\d+)/(\d+) on (\S+): weights checksum ([0-9a-f]{16})$", re.M)


def _require_deps(*tools: str) -> None:
    missing = [t for t in tools if not (VENV / "bin" / t).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not in {VENV}/bin: run `bash scripts/install-e2e-deps.sh` "
                    "(scripts/test.sh does)")


@pytest.fixture(scope="module")
def e2e_lab(lab_factory):
    """Three lab hosts (2 slots each) for every playbook of this module."""
    return lab_factory("e", 3)






def playbook(lab, tmp_path: Path, cluster_file: str, inventory_args: list[str], *, documented: bool = True,
             **job) -> Path:
    """The playbook's cluster file, run against `lab`: its inventory (a lab inventory of the
    default lab, /var/tmp/orch-lab/lab/...) becomes this lab's, or with `inventory_args` one
    derived from it by playbooks/lab_inventory.py (which, when `documented`, the playbook must
    tell users to run with those arguments); sync paths become absolute; `job` overrides."""
    src = PLAYBOOKS / cluster_file
    text = src.read_text()
    doc = yaml.safe_load(text)
    inv = Path(doc["inventory"])
    assert inv.parent == Path("/var/tmp/orch-lab/lab"), f"{src}: inventory {inv} is not in the default lab"
    if inv.name != "inventory.yaml" and documented:
        line = f"python3 playbooks/lab_inventory.py {inv.name} {' '.join(inventory_args)}"
        assert line in text, f"{src} does not document `{line}`"
    if inventory_args:
        res = subprocess.run([sys.executable, str(PLAYBOOKS / "lab_inventory.py"), str(tmp_path / "inventory.yaml"),
                              "--lab", lab.name, *inventory_args], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "ORCH_LAB_ROOT": str(lab.root)})
        assert res.returncode == 0, res.stderr
        doc["inventory"] = res.stdout.strip()
    else:
        doc["inventory"] = str(lab.inventory_path)
    doc["job"]["sync"] = [str((src.parent / s).resolve()) for s in doc["job"].get("sync", [])]
    doc["job"].update(job)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def up_ok(tmp_path: Path, timeout: float) -> tuple[dict, float]:
    res, took = timed(orch, "up", "-q", cwd=tmp_path, timeout=timeout)
    assert res.returncode == 0, (res.stdout.decode()[-3000:], res.stderr.decode()[-5000:])
    rec = run_record(tmp_path)
    assert rec["state"] == "succeeded" and set(rec["exit_codes"].values()) == {0}, rec["exit_codes"]
    left = leftovers(rec["id"])
    assert left == [], described(left)
    return rec, took


def healthy_up(lab, tmp_path: Path, cluster_file: str, inventory_args: list[str], **job) -> float:
    """Seconds `orch up` takes for the playbook with ranks that end at once: launch, follow, gather."""
    (tmp_path / "ok.py").write_text("print('ok', flush=True)\n")
    playbook(lab, tmp_path, cluster_file, inventory_args, **{**job, "command": "python ok.py",
                                                             "sync": [str(tmp_path / "ok.py")]})
    return up_ok(tmp_path, timeout=240)[1]


def up_fails_naming(tmp_path: Path, lab, *, rank: int, host: int, code: int, healthy: float) -> dict:
    """`orch up` of a job whose rank `rank` (on lab host `host`) exits `code` after printing
    "failing on purpose": exit 1 well before the others' sleep ends (within the `healthy` run's
    time plus the stop's grace), that rank named with its own exit code and its last lines, the
    run recorded as failed, nothing left running."""
    res, took = timed(orch, "up", "-q", cwd=tmp_path, timeout=240)
    assert res.returncode == 1, (res.stdout.decode(), res.stderr.decode())
    print(f"failing run {took:.1f}s, healthy {healthy:.1f}s")
    assert took < budget(healthy, STOP_GRACE)
    err = res.stderr.decode()
    assert f"rank {rank} on {lab.host_name(host)}" in err and f"exit code {code}" in err \
        and "failing on purpose" in err, err
    rec = run_record(tmp_path)
    assert rec["state"] == "failed" and rec["first_failure"]["rank"] == rank \
        and rec["first_failure"]["exit_code"] == code
    left = leftovers(rec["id"])
    assert left == [], described(left)
    return rec


def assert_trained(tmp_path: Path, lab, hosts_of_rank: list[int]) -> dict[int, list[float]]:
    """Every rank: loss lines, last below first, the last one as the hosts' supervisors read it
    (run.json's progress); one checksum line naming the rank, the world size and the lab host
    the plan put it on; the same checksum everywhere."""
    size = len(hosts_of_rank)
    sums, losses = {}, {}
    progress = run_record(tmp_path).get("progress") or {}
    for rank in range(size):
        res = orch("logs", "--rank", str(rank), cwd=tmp_path, timeout=60)
        assert res.returncode == 0, res.stderr.decode()
        out = res.stdout.decode("utf-8", "replace")
        losses[rank] = [float(m.group(3)) for m in LOSS.finditer(out)]
        # the figures the hosts' supervisors read from the output (agent/metrics.py) are the log's
        last = list(LOSS.finditer(out))[-1]
        mine = progress.get(str(rank)) or {}
        assert (mine.get("epoch"), mine.get("step"), mine.get("loss"), mine.get("records")) == \
            (int(last.group(1)), int(last.group(2)), float(last.group(3)), len(losses[rank])), (rank, mine)
        assert len(losses[rank]) >= 3, f"rank {rank}: too few loss lines:\n{out[-3000:]}"
        assert losses[rank][-1] < losses[rank][0], f"rank {rank} did not learn: {losses[rank]}"
        found = CHECKSUM.findall(out)
        assert len(found) == 1, f"rank {rank}: no (single) checksum line:\n{out[-3000:]}"
        r, n, host, digest = found[0]
        assert (int(r), int(n), host) == (rank, size, lab.host_name(hosts_of_rank[rank])), found[0]
        sums[rank] = digest
    assert len(set(sums.values())) == 1, f"ranks ended with different weights: {sums}"
    return losses


# --------------------------------------------------------------------------- MindSpore over msrun


@pytest.mark.timeout(900)
def test_mindspore_msrun_2_hosts_x_2_workers(e2e_lab, tmp_path):
    """Seed 004's network, really trained by MindSpore 2.10.0 on CPU: one msrun per host,
    4 workers, gradients all-reduced between the two hosts every step."""
    _require_deps("msrun", "python")
    playbook(e2e_lab, tmp_path, "mindspore-msrun/cluster.yaml", ["--hosts", "2"])
    rec, took = up_ok(tmp_path, timeout=840)
    print(f"mindspore msrun 2x2: orch up took {took:.1f}s")
    assert [c["command"].split()[0] for h in rec["commands"].values() for c in h] == ["msrun", "msrun"]
    assert_trained(tmp_path, e2e_lab, [1, 1, 2, 2])  # worker_N.log on its host is rank N


@pytest.mark.timeout(300)
def test_msrun_failing_worker_is_named_with_its_own_exit_code(e2e_lab, tmp_path):
    """msrun exits 1 for its whole host whichever worker failed; orch still names the rank
    that failed, with that rank's exit code, and stops everything. Rank 3 fails once its
    neighbour on that host, rank 2, has said it is up (a file of this run's beside them): else a
    busy machine can have msrun kill rank 2 before it printed a word (seen once in a full run)."""
    _require_deps("msrun")
    (tmp_path / "fail.py").write_text(
        "import os, sys, time\n"
        "r = os.environ['RANK_ID']\n"
        "print(f'rank {r} up', flush=True)\n"
        "if os.environ.get('MS_ROLE') == 'MS_WORKER':\n"
        "    mark = 'up.%s.' % os.environ['ORCH_RUN_ID']\n"
        "    open(mark + r, 'w').close()\n"
        "    if r == '3':\n"
        "        for _ in range(600):\n"
        "            if os.path.exists(mark + '2'):\n"
        "                break\n"
        "            time.sleep(0.1)\n"
        "        print('failing on purpose', flush=True); sys.exit(3)\n"
        "time.sleep(120)\n")
    healthy = healthy_up(e2e_lab, tmp_path, "mindspore-msrun/cluster.yaml", ["--hosts", "2"],
                         workdir="/data/e2e-msrun-fail", timeout=120)
    playbook(e2e_lab, tmp_path, "mindspore-msrun/cluster.yaml", ["--hosts", "2"], workdir="/data/e2e-msrun-fail",
             command="python fail.py", sync=[str(tmp_path / "fail.py")], timeout=120)
    rec = up_fails_naming(tmp_path, e2e_lab, rank=3, host=2, code=3, healthy=healthy)
    assert rec["exit_codes"]["3"] == 3 and rec["exit_codes"]["2"] != 0
    assert orch("logs", "--rank", "2", cwd=tmp_path).stdout == b"rank 2 up\n"


# --------------------------------------------------------------------------- PyTorch over torchrun


@pytest.mark.timeout(600)
def test_torch_ddp_torchrun_2_hosts_x_2_workers(e2e_lab, tmp_path):
    """PyTorch DDP (gloo, CPU) really trained: one torchrun per host, 4 workers, gradients
    all-reduced between the two hosts every step; `orch logs --rank N` is worker N's output."""
    _require_deps("torchrun", "python")
    playbook(e2e_lab, tmp_path, "torch-ddp/cluster.yaml", ["--hosts", "2"])
    rec, took = up_ok(tmp_path, timeout=540)
    print(f"torch ddp torchrun 2x2: orch up took {took:.1f}s")
    assert [c["command"].split()[0] for h in rec["commands"].values() for c in h] == ["torchrun", "torchrun"]
    assert_trained(tmp_path, e2e_lab, [1, 1, 2, 2])


@pytest.mark.timeout(300)
def test_torchrun_failing_worker_is_named_and_everything_stops(e2e_lab, tmp_path):
    """One worker fails: orch names that rank with its own exit code (torchrun alone would
    only say its host's group failed), stops every other rank on every host, and the logs of
    the others are theirs; `orch down` has nothing left to stop."""
    _require_deps("torchrun")
    (tmp_path / "fail.py").write_text(
        "import os, sys, time\n"
        "r = os.environ['RANK']\n"
        "print(f'rank {r} of {os.environ[\"WORLD_SIZE\"]} local {os.environ[\"LOCAL_RANK\"]}', flush=True)\n"
        "if r == '2':\n"
        "    time.sleep(3)  # once the others have started and said so: their logs are checked below\n"
        "    print('failing on purpose', flush=True); sys.exit(7)\n"
        "time.sleep(120)\n")
    healthy = healthy_up(e2e_lab, tmp_path, "torch-ddp/cluster.yaml", ["--hosts", "2"],
                         workdir="/data/e2e-torch-fail", timeout=120)
    playbook(e2e_lab, tmp_path, "torch-ddp/cluster.yaml", ["--hosts", "2"], workdir="/data/e2e-torch-fail",
             command="python fail.py", sync=[str(tmp_path / "fail.py")], timeout=120)
    rec = up_fails_naming(tmp_path, e2e_lab, rank=2, host=2, code=7, healthy=healthy)
    assert orch("logs", "--rank", "1", cwd=tmp_path).stdout == b"rank 1 of 4 local 1\n"
    assert orch("down", "--run", rec["id"], cwd=tmp_path).returncode == 0


# --------------------------------------------------------------------------- MPI over mpirun


@pytest.mark.timeout(600)
def test_mpi_allreduce_3_hosts(e2e_lab, tmp_path):
    """mpi4py MPI_Allreduce of the gradients across 3 hosts x 2 slots, started by one mpirun."""
    _require_deps("python")
    probe = subprocess.run([str(VENV / "bin" / "python"), "-c", "import mpi4py, numpy"], capture_output=True,
                           text=True)
    assert probe.returncode == 0, f"mpi4py/numpy missing in {VENV}: run scripts/install-e2e-deps.sh\n{probe.stderr}"
    playbook(e2e_lab, tmp_path, "mpi-allreduce/cluster.yaml", [])
    rec, took = up_ok(tmp_path, timeout=540)
    print(f"mpi allreduce 3x2: orch up took {took:.1f}s")
    assert [c["command"].split()[0] for h in rec["commands"].values() for c in h] == ["mpirun"]
    assert_trained(tmp_path, e2e_lab, [1, 1, 2, 2, 3, 3])


# --------------------------------------------------------------------------- launch contracts


def env_ok_lines(tmp_path: Path) -> list[str]:
    res = orch("logs", cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode().splitlines()


@pytest.mark.parametrize("cluster_file,inventory_args,expect", [
    ("ascend-ranktable/1x8.yaml", ["--hosts", "1", "--slots", "8"],
     [(r, r, 1) for r in range(8)]),
    ("ascend-ranktable/partial-4-7.yaml", ["--hosts", "1", "--devices", "4,5,6,7"],
     [(r, 4 + r, 1) for r in range(4)]),
    ("ascend-ranktable/2x8.yaml", ["--hosts", "2", "--slots", "8"],
     [(r, r % 8, 1 + r // 8) for r in range(16)]),
])
def test_ascend_ranktable_playbooks_pass_their_env_checks(e2e_lab, tmp_path, cluster_file, inventory_args, expect):
    """Every rank's DEVICE_ID/RANK_ID/RANK_SIZE/DEVICE_NUM agree with the rank table and the
    host's /etc/hccn.conf (playbooks/ascend/check_env.py exits 1 otherwise)."""
    playbook(e2e_lab, tmp_path, cluster_file, inventory_args)
    up_ok(tmp_path, timeout=240)
    lines = env_ok_lines(tmp_path)
    size = len(expect)
    assert lines == [f"[rank {r}] env ok: rank {r}/{size} device {d} ip 192.168.{100 + d}.{10 + h} "
                     f"server {e2e_lab.host(h).address} host {e2e_lab.host_name(h)}" for r, d, h in expect], lines


def test_gpu_mpirun_playbook_devices_2_3(e2e_lab, tmp_path):
    """devices [2,3] -> CUDA_VISIBLE_DEVICES=2,3 on every rank of both hosts, ranks contiguous per host."""
    playbook(e2e_lab, tmp_path, "gpu-mpirun/cluster.yaml", ["--hosts", "2", "--devices", "2,3"])
    up_ok(tmp_path, timeout=240)
    lines = env_ok_lines(tmp_path)
    assert lines == [f"[rank {r}] gpu env ok: rank {r}/4 local {r % 2}/2 host {e2e_lab.host_name(1 + r // 2)} "
                     f"node {r // 2} CUDA_VISIBLE_DEVICES=2,3 gpu {2 + r % 2}" for r in range(4)], lines


def test_gpu_check_script_fails_loudly_when_the_plan_differs(e2e_lab, tmp_path):
    """The control: the same playbook on GPUs [0,1] (no CUDA_VISIBLE_DEVICES exported) must fail."""
    playbook(e2e_lab, tmp_path, "gpu-mpirun/cluster.yaml", ["--hosts", "2", "--devices", "0,1"], documented=False)
    res = orch("up", "-q", cwd=tmp_path, timeout=240)
    assert res.returncode == 1, (res.stdout.decode(), res.stderr.decode())
    assert "GPU ENV CHECK FAILED" in res.stderr.decode() and "CUDA_VISIBLE_DEVICES is not set" in res.stderr.decode()


# --------------------------------------------------------------------------- msrun, many times


@pytest.mark.timeout(1500)
def test_msrun_twenty_runs_in_a_row_each_reported_as_it_ended(e2e_lab, tmp_path):
    """The supervision loop for msrun (mpirun and ranktable have theirs in tests/faults/
    test_supervision.py): 20 consecutive `orch up` of a 2x2 msrun job whose workers all exit 0
    exit 0 with every exit code recorded 0; 20 more with rank 3 failing exit 1 naming rank 3,
    its host and its own exit code, with nothing left running. (A success reported as a failure
    one time in three went unnoticed while every test ran once.)"""
    _require_deps("msrun")
    (tmp_path / "job.py").write_text(
        "import os, sys, time\n"
        "r = os.environ['RANK_ID']\n"
        "print(f'rank {r} up', flush=True)\n"
        "if os.environ.get('MS_ROLE') == 'MS_WORKER' and r == '3' and os.environ.get('FAIL') == '1':\n"
        "    print('failing on purpose', flush=True); sys.exit(3)\n"
        "time.sleep(30 if os.environ.get('FAIL') == '1' else 0)\n")
    n = int(os.environ.get("ORCH_LOOP_RUNS", "20"))
    took: list[float] = []  # the healthy runs' times: what a failing run is held to
    for fail in ("0", "1"):
        playbook(e2e_lab, tmp_path, "mindspore-msrun/cluster.yaml", ["--hosts", "2"], workdir="/data/e2e-msrun-loop",
                 command="python job.py", sync=[str(tmp_path / "job.py")], timeout=120,
                 env={**yaml.safe_load((PLAYBOOKS / "mindspore-msrun/cluster.yaml").read_text())["job"]["env"],
                      "FAIL": fail})
        for i in range(n):
            if fail == "0":
                rec, t = up_ok(tmp_path, timeout=240)
                took.append(t)
                assert sorted(rec["exit_codes"]) == ["0", "1", "2", "3"], (i, rec["exit_codes"])
            else:
                up_fails_naming(tmp_path, e2e_lab, rank=3, host=2, code=3, healthy=sorted(took)[len(took) // 2])
