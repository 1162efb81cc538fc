"""A host dies mid-run: the run's head puts a spare in its place, on the cluster, with the
controller detached (docs/spares.md). Real lab hosts, real processes killed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.launchers import ranktable
from orchestrator.rankplan import make_plan, replaced
from orchestrator.spec import load_cluster
from tests.support import host_procs, kill_run_on, leftovers, orch, wait_until, write_fault_cluster

pytestmark = pytest.mark.lab

# each rank says where it runs and what its rank table says of it; attempt 1 waits to be killed
SHOW = ("import json, os, sys, time\n"
        "e = os.environ\n"
        "r = e.get('RANK_ID') or e.get('OMPI_COMM_WORLD_RANK')\n"
        "t = json.load(open(e['RANK_TABLE_FILE'])) if e.get('RANK_TABLE_FILE') else None\n"
        "me = [(s['server_id'], d['device_ip']) for s in t['server_list'] for d in s['device'] if d['rank_id'] == r]"
        " if t else [('-', '-')]\n"
        "print(os.uname().nodename, r, e.get('DEVICE_ID', '-'), me[0][0], me[0][1], e['ORCH_ATTEMPT'],"
        " e.get('ORCH_REPLACED_HOSTS') or '-', flush=True)\n"
        "time.sleep(300 if e['ORCH_ATTEMPT'] == '1' else 0)\n")


@pytest.fixture(scope="module")
def sp(fx_lab):
    return fx_lab("p", 3)


def _cluster(lab, tmp_path: Path, workdir: str, *, slots: int, **job) -> Path:
    inv = yaml.safe_load(Path(lab.inventory_path).read_text())
    inv["defaults"] = {**inv["defaults"], "slots": slots}
    inv["spares"] = 1
    return write_fault_cluster(lab, tmp_path, workdir=workdir, command=["python3", "-c", SHOW], inventory=inv,
                               checks={"versions": ["python"]}, **job)


def _status(cwd) -> dict:
    return json.loads(orch("status", "--json", cwd=cwd, check_rc=None).stdout)


def _replace_mid_run(lab, tmp_path: Path, ranks: int) -> tuple[str, dict]:
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: len(host_procs(lab, 2, run_id)) >= 2 and _status(tmp_path)["state"] == "running", 40)
    assert wait_until(lambda: sum(r["state"] == "running" for r in _status(tmp_path)["ranks"]) == ranks, 30)
    kill_run_on(lab, 2, run_id)
    assert wait_until(lambda: _status(tmp_path)["state"] in ("succeeded", "failed", "lost"), 60)
    st = _status(tmp_path)
    assert wait_until(lambda: not leftovers(run_id), 20), leftovers(run_id)
    return run_id, st


def _hccn(lab, i: int) -> dict[int, str]:
    conf = dict(x.split("=", 1) for x in (lab.host_dir(i) / "hccn.conf").read_text().split())
    return {int(k.split("_")[1]): v for k, v in conf.items() if k.startswith("address_")}


def test_ranktable_2x8_host_killed_its_ranks_move_to_the_spare_with_a_rank_table_rendered_on_the_cluster(sp, tmp_path):
    """ranktable, platform ascend, 2 hosts x 8 + 1 spare: everything on host 2 killed mid-run
    (kill -9, its supervisor too). Attempt 2 runs ranks 8-15 on the spare with the same RANK_ID
    and DEVICE_ID; its rank table lists the spare's server id and device IPs in host 2's place
    and equals what orch renders for that host set; the run succeeds, the controller detached."""
    path = _cluster(sp, tmp_path, "/data/sp-rt", slots=8, launcher="ranktable", platform="ascend")
    run_id, st = _replace_mid_run(sp, tmp_path, 16)
    h1, h2, spare = sp.host(1), sp.host(2), sp.host(3)
    assert st["state"] == "succeeded", st
    assert [(a["attempt"], a["hosts"]) for a in st["attempts"]] == [(1, [h1.name, h2.name]), (2, [h1.name, spare.name])]
    assert st["replaced"][0]["host"] == h2.name and st["replaced"][0]["by"] == spare.name
    assert "connection to its supervisor closed" in st["replaced"][0]["why"]
    ips = {1: _hccn(sp, 1), 3: _hccn(sp, 3)}
    for rank in range(16):
        node = 1 if rank < 8 else 3
        out = orch("logs", "--rank", rank, "--attempt", 2, cwd=tmp_path, check_rc=0).stdout.decode().split()
        assert out == [sp.host(node).name, str(rank), str(rank % 8), sp.host(node).address, ips[node][rank % 8], "2",
                       f"{h2.name}->{spare.name}"], (rank, out)
    # attempt 1's logs of host 2's ranks are still found where they ran
    assert orch("logs", "--rank", 9, "--attempt", 1, cwd=tmp_path, check_rc=0).stdout.decode().split()[:3] == \
        [h2.name, "9", "1"]
    cluster = load_cluster(path)
    plan = replaced(make_plan(cluster), {h2.name: spare.name})
    want = ranktable.rank_table(cluster, plan, {h1.name: ips[1], spare.name: ips[3]})
    for node in (1, 3):
        got = sp.exec(node, ["cat", "/data/sp-rt/rank_table.json"]).stdout
        assert got == want, node
    text = orch("status", cwd=tmp_path, check_rc=0).stdout.decode()
    assert f"spare {spare.name} took the place of {h2.name}" in text


def test_mpirun_host_killed_the_spare_takes_its_ranks_in_a_hostfile_rendered_on_the_cluster(sp, tmp_path):
    """mpirun, 2 hosts x 2 + 1 spare: the same replacement with the hostfile: attempt 2's mpirun
    runs ranks 2-3 on the spare."""
    _cluster(sp, tmp_path, "/data/sp-mpi", slots=2, launcher="mpirun")
    run_id, st = _replace_mid_run(sp, tmp_path, 4)
    h2, spare = sp.host(2), sp.host(3)
    assert st["state"] == "succeeded", st
    assert st["attempts"][1]["hosts"] == [sp.host(1).name, spare.name]
    for rank in range(4):
        node = 1 if rank < 2 else 3
        out = orch("logs", "--rank", rank, "--attempt", 2, cwd=tmp_path, check_rc=0).stdout.decode().split()
        assert out[:2] == [sp.host(node).name, str(rank)] and out[5:] == ["2", f"{h2.name}->{spare.name}"], out
    hostfile = sp.exec(1, ["cat", "/data/sp-mpi/hostfile"]).stdout
    assert hostfile.splitlines()[1:] == [f"{sp.host(1).address} slots=2", f"{spare.address} slots=2"]


def test_no_spare_left_the_run_ends_naming_the_failed_host_and_the_spares(sp, tmp_path):
    """The spare itself killed first (the run goes on), then host 2: no spare is left, the run
    ends `lost` with exit 1, naming host 2 and what became of the spare."""
    _cluster(sp, tmp_path, "/data/sp-none", slots=1, launcher="ranktable")
    run_id = orch("up", "-q", "--detach", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    assert wait_until(lambda: sum(r["state"] == "running" for r in _status(tmp_path)["ranks"]) == 2, 40)
    kill_run_on(sp, 3, run_id)
    time.sleep(1)
    assert _status(tmp_path)["state"] == "running"
    kill_run_on(sp, 2, run_id)
    assert wait_until(lambda: _status(tmp_path)["state"] == "lost", 60)
    res = orch("status", "--json", cwd=tmp_path, check_rc=1)
    st = json.loads(res.stdout)
    h2, spare = sp.host(2).name, sp.host(3).name
    assert f"lost contact with host {h2}" in st["message"]
    assert f"no spare host left to take the place of {h2}" in st["message"] and f"{spare} was lost" in st["message"]
    assert wait_until(lambda: not leftovers(run_id), 20), leftovers(run_id)
