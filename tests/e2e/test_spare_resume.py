"""The 3 a.m. case, end to end: real PyTorch DDP (torchrun, gloo) on two lab hosts and a spare,
checkpoints on a directory every host shares (`orch lab up --shared`). A training host's link is
cut mid-run with the controller detached: the run's head puts the spare in its place, the job
resumes from its checkpoint and ends with the weights an undisturbed run ends with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_training import CHECKSUM, _require_deps, playbook
from tests.support import leftovers, orch, wait_until

pytestmark = pytest.mark.lab
SHARED = "/data/shared"


@pytest.fixture(scope="module")
def spare_lab(lab_factory):
    return lab_factory("r", 3, shared=SHARED)


def _cluster(lab, tmp_path: Path, ckpt: str, **env) -> Path:
    path = playbook(lab, tmp_path, "torch-ddp/cluster.yaml", [], workdir="/data/spare-ddp", timeout=300)
    doc = yaml.safe_load(path.read_text())
    doc["inventory"] = {**yaml.safe_load(Path(lab.inventory_path).read_text()), "spares": 1}
    doc["inventory"]["defaults"]["slots"] = 1
    doc["job"]["env"].update({"CKPT_DIR": f"{SHARED}/{ckpt}", "EPOCHS": "5", **env})
    doc.setdefault("ssh", {}).update({"connect_timeout": 2, "retries": 1})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _checksum(tmp_path: Path, rank: int, attempt: int) -> str:
    out = orch("logs", "--rank", rank, "--attempt", attempt, cwd=tmp_path, check_rc=0).stdout.decode()
    found = CHECKSUM.findall(out)
    assert len(found) == 1, out[-2000:]
    return found[0][3]


def test_torch_ddp_link_cut_resumes_on_the_spare_with_the_undisturbed_weights(spare_lab, tmp_path):
    _require_deps("torchrun", "python")
    lab = spare_lab
    calm, cut = tmp_path / "calm", tmp_path / "cut"
    calm.mkdir()
    cut.mkdir()
    for ck in ("calm", "cut"):
        lab.exec(1, ["mkdir", "-p", f"{SHARED}/{ck}"])
    _cluster(lab, calm, "calm")
    orch("up", "-q", cwd=calm, check_rc=0, timeout=300)
    want = _checksum(calm, 0, 1)
    assert _checksum(calm, 1, 1) == want

    _cluster(lab, cut, "cut", EPOCH_SLEEP="2")
    run_id = orch("up", "-q", "--detach", cwd=cut, check_rc=0).stdout.decode().strip()
    ckpt = lab.state_dir / "shared" / "cut" / "ckpt.pt"
    assert wait_until(ckpt.exists, 120), "no checkpoint after the first epoch"
    lab.link(2, False)
    try:
        assert wait_until(lambda: json.loads(orch("status", "--json", cwd=cut).stdout)["state"]
                          in ("succeeded", "failed", "lost"), 180)
    finally:
        lab.link(2, True)
    st = json.loads(orch("status", "--json", cwd=cut).stdout)
    assert st["state"] == "succeeded", st["message"]
    assert [a["hosts"] for a in st["attempts"]] == [[lab.host_name(1), lab.host_name(2)],
                                                   [lab.host_name(1), lab.host_name(3)]]
    assert "silent" in st["replaced"][0]["why"]
    resumed = orch("logs", "--rank", 1, "--attempt", 2, cwd=cut, check_rc=0).stdout.decode()
    assert "resumed from" in resumed and lab.host_name(3) in resumed
    assert _checksum(cut, 0, 2) == want and _checksum(cut, 1, 2) == want
    assert wait_until(lambda: not leftovers(run_id), 30), leftovers(run_id)
