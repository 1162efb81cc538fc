"""A launch host with two networks (a login node that also trains, a bastion in the job): the
controller reaches it on network A only, the other hosts reach it on network B only, and the
cluster file says nothing about it (no mpi_address, no job.interface). mpirun, ranktable and
torchrun jobs must run as on any cluster: the supervisors find the address that works, and
torchrun's master address and MASTER_ADDR are that address."""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_training import _require_deps, assert_trained, playbook, up_ok
from tests.support import orch

pytestmark = pytest.mark.lab


def _no_pins(lab, path):
    doc = yaml.safe_load(path.read_text())
    doc["job"].pop("interface", None)       # nothing pins the launch host's address
    inv = yaml.safe_load(open(doc["inventory"]).read()) if isinstance(doc["inventory"], str) else doc["inventory"]
    assert all("mpi_address" not in h for h in inv["hosts"]) and "mpi_address" not in inv.get("defaults", {})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))



def _plain(lab, tmp_path, launcher, command):
    """A cluster file of this lab's inventory as written (nothing pinned) running `command`."""
    doc = {"inventory": str(lab.inventory_path), "ssh": {"connect_timeout": 5},
           "job": {"launcher": launcher, "platform": "cpu", "workdir": f"/data/dh-{launcher}",
                   "command": ["sh", "-c", command]}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(doc))


@pytest.mark.timeout(600)
def test_mpirun_runs_with_a_dual_homed_launch_host_and_trains_once_btl_is_pinned(dual_homed_lab, tmp_path):
    """orch's part needs nothing: mpirun starts on the launch host and its ranks on every host,
    each reported. Open MPI's own TCP traffic between ranks, though, hangs trying the launch host's
    controller-side network (a hand-run `mpirun` there hangs the same way); `orch check` says so
    and names the fix, with which the real all-reduce trains."""
    _require_deps("python")
    lab = dual_homed_lab
    _plain(lab, tmp_path, "mpirun", 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"')
    rec, _ = up_ok(tmp_path, timeout=240)
    assert rec["head"] == lab.host_name(1)
    res = orch("check", cwd=tmp_path, timeout=120)
    out = res.stdout.decode() + res.stderr.decode()
    assert res.returncode == 0 and "btl_tcp_if_include" in out, out
    net = lab.peer_address(1).rsplit(".", 1)[0] + ".0/24"
    _no_pins(lab, playbook(lab, tmp_path, "mpi-allreduce/cluster.yaml", [],
                           mpirun_args=["-mca", "btl_tcp_if_include", net]))
    rec, took = up_ok(tmp_path, timeout=540)
    print(f"mpirun, dual-homed launch host: orch up took {took:.1f}s")
    slots = yaml.safe_load(lab.inventory_path.read_text())["defaults"].get("slots", 1)
    assert_trained(tmp_path, lab, [h for h in (1, 2, 3) for _ in range(slots)])


@pytest.mark.timeout(300)
def test_ranktable_ranks_see_the_address_the_hosts_reach(dual_homed_lab, tmp_path):
    lab = dual_homed_lab
    _plain(lab, tmp_path, "ranktable", 'echo "$RANK_ID $MASTER_ADDR"')
    up_ok(tmp_path, timeout=240)
    out = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode()
    addrs = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert addrs == {lab.peer_address(1)}, out   # network B: what hosts 2 and 3 reach
    assert lab.host(1).address not in out


@pytest.mark.timeout(600)
def test_torchrun_trains_with_a_dual_homed_launch_host(dual_homed_lab, tmp_path):
    _require_deps("torchrun", "python")
    lab = dual_homed_lab
    _no_pins(lab, playbook(lab, tmp_path, "torch-ddp/cluster.yaml", []))
    rec, took = up_ok(tmp_path, timeout=540)
    print(f"torchrun, dual-homed launch host: orch up took {took:.1f}s")
    slots = yaml.safe_load(lab.inventory_path.read_text())["defaults"].get("slots", 1)
    assert_trained(tmp_path, lab, [h for h in (1, 2, 3) for _ in range(slots)])
    cmds = " ".join(c["command"] for h in rec["commands"].values() for c in h)
    assert "@ORCH_HEAD_ADDR@" in cmds   # the record shows what was rendered; each host put in the address
