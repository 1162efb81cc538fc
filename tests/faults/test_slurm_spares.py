"""Spare nodes on Slurm (`slurm.spares`): asked for up front (`sbatch --nodes=nodes+spares
--no-kill`), idle under their supervisor until a node of the run is lost, then in its place.
Its own Slurm lab (3 nodes), so that the 2-node Slurm tests keep theirs."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.faults.test_slurm import job_state, queue
from tests.faults.test_spares import SHOW
from tests.support import kill_run_on, leftovers, orch, run_record, wait_until

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def sw(lab_factory):
    return lab_factory("w", 3, slurm=True)


def test_a_lost_node_is_replaced_by_the_spare_node_of_the_allocation(sw, tmp_path):
    inv = yaml.safe_load(sw.slurm_inventory_path.read_text())
    inv["defaults"]["slots"] = 2
    inv["slurm"].update(nodes=2, spares=1)
    doc = {"inventory": inv, "ssh": {"connect_timeout": 3, "command_timeout": 30, "retries": 2},
           "job": {"workdir": "/data/sw", "command": ["python3", "-c", SHOW], "launcher": "ranktable"},
           "checks": {"versions": ["python"]}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()

    def status() -> dict:
        return json.loads(orch("status", "--json", cwd=tmp_path).stdout)

    assert wait_until(lambda: sum(r["state"] == "running" for r in status()["ranks"]) == 4, 60), status()
    kill_run_on(sw, 2, run_id)
    assert wait_until(lambda: status()["state"] in ("succeeded", "failed", "lost"), 90)
    st = status()
    n1, n2, n3 = (sw.host(i).name for i in (1, 2, 3))
    assert st["state"] == "succeeded", st
    assert [a["hosts"] for a in st["attempts"]] == [[n1, n2], [n1, n3]]
    for rank in (2, 3):
        out = orch("logs", "--rank", rank, "--attempt", 2, cwd=tmp_path, check_rc=0).stdout.decode().split()
        assert out[:2] == [n3, str(rank)] and out[-2:] == ["2", f"{n2}->{n3}"], out
    job = run_record(tmp_path)["slurm"]["job_id"]
    assert wait_until(lambda: queue(sw) == [], 60), queue(sw)
    assert job_state(sw, job) == "COMPLETED"
    assert wait_until(lambda: not leftovers(run_id), 20), leftovers(run_id)
