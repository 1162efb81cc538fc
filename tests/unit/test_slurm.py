"""Slurm's pure parts: the inventory, sbatch/srun commands, parsers of Slurm's output, and
what Slurm's word does to a run's state. Real Slurm is tested in tests/faults/test_slurm.py."""

from __future__ import annotations

import pytest
import yaml

from orchestrator import slurm
from orchestrator.errors import SpecError
from orchestrator.runstate import RunView
from orchestrator.spec import load_cluster


def _write(tmp_path, inventory, **job):
    doc = {"inventory": inventory, "job": {"workdir": "/data/w", "command": "true", **job}}
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def test_a_slurm_inventory_has_no_hosts_and_carries_the_defaults(tmp_path):
    c = load_cluster(_write(tmp_path, {"defaults": {"user": "train", "slots": 8, "identity_file": "k"},
                                       "slurm": {"nodes": 4, "partition": "gpu", "time": "01:00:00",
                                                 "gres": "gpu:8", "exclusive": True, "extra": ["--mem=0"],
                                                 "conf": "slurm.conf"}}))
    assert c.hosts == () and c.slurm is not None
    s = c.slurm
    assert (s.nodes, s.partition, s.time, s.gres, s.exclusive, s.extra) == (4, "gpu", "01:00:00", "gpu:8", True,
                                                                            ("--mem=0",))
    assert s.template.user == "train" and s.template.slots == 8 and s.template.devices == tuple(range(8))
    assert s.template.identity_file == str(tmp_path / "k") and s.conf == str(tmp_path / "slurm.conf")


@pytest.mark.parametrize("inventory, needle", [
    ({"slurm": {"nodes": 2}, "hosts": [{"address": "10.0.0.1"}]}, "exactly one of 'hosts:'"),
    ({"slurm": {"nodes": 0}}, "nodes must be at least 1"),
    ({"slurm": {"nodes": 2, "time": "one hour"}}, "not a Slurm time limit"),
    ({"slurm": {"nodes": 2, "partiton": "x"}}, "unknown key 'partiton'"),
    ({"slurm": {"nodes": 2}, "groups": {"g": ["a"]}}, "a Slurm inventory lists none"),
    ({"defaults": {}}, "missing required key 'hosts' (or 'slurm')"),
])
def test_bad_slurm_inventories_are_located_errors(tmp_path, inventory, needle):
    with pytest.raises(SpecError) as exc:
        load_cluster(_write(tmp_path, inventory))
    text = str(exc.value)
    assert needle in text and "cluster.yaml:" in text, text


def test_sbatch_asks_one_task_per_rank_and_passes_every_setting(tmp_path):
    c = load_cluster(_write(tmp_path, {"defaults": {"slots": 4},
                                       "slurm": {"nodes": 3, "partition": "p", "account": "a", "qos": "q",
                                                 "constraint": "ib", "exclusive": True, "extra": ["--mem=0"]}}))
    argv = slurm.sbatch_argv(c.slurm, slurm.job_name("my job"), "/data/w")
    assert argv[:5] == ["sbatch", "--parsable", "--job-name=orch-my_job", "--nodes=3", "--ntasks-per-node=4"]
    for want in ("--partition=p", "--account=a", "--qos=q", "--constraint=ib", "--exclusive", "--comment=orch - /data/w"):
        assert want in argv
    assert argv[-1] == "--mem=0" and not any(a.startswith("--time") for a in argv)


def test_the_batch_script_waits_for_orch_then_hands_over_to_the_supervisor():
    text = slurm.batch_script("/data/my dir", wait=2)
    assert text.startswith("#!/bin/sh\n")
    assert "go='/data/my dir/.orch/'\"slurm-$SLURM_JOB_ID.go\"" in text
    assert "-le 20 ]" in text  # 2 s at 10 checks a second, then the nodes go back
    assert text.rstrip().endswith('exec python3 -S "$rundir/agent.py" batch "$go"')


def test_parsers_of_slurms_output():
    assert slurm.parse_sbatch("1234\n") == "1234" and slurm.parse_sbatch("77;cluster\n") == "77"
    with pytest.raises(slurm.SlurmError):
        slurm.parse_sbatch("sbatch: error: nope\n")
    job = slurm.parse_job("9", "JobId=9 JobName=orch-x UserId=root(0) JobState=RUNNING Reason=None "
                               "Dependency=(null) NodeList=gpu[01-03,07] BatchHost=gpu01 NumNodes=4")
    assert (job.state, job.reason, job.nodes, job.batch_host, job.live) == (
        "RUNNING", "", ("gpu01", "gpu02", "gpu03", "gpu07"), "gpu01", True)
    pend = slurm.parse_job("9", "JobId=9 JobState=PENDING Reason=Resources NodeList=(null) BatchHost=(null)")
    assert (pend.state, pend.reason, pend.nodes, pend.batch_host) == ("PENDING", "Resources", (), "")
    assert slurm.parse_job("9", "JobId=9 JobState=CANCELLED+ Reason=None").live is False
    assert slurm.parse_nodes("NodeName=a1 Arch=x NodeAddr=10.0.0.1 NodeHostName=a1\n"
                             "NodeName=a2 NodeAddr= NodeHostName=a2.cluster\n") == {"a1": "10.0.0.1",
                                                                                      "a2": "a2.cluster"}
    assert slurm.parse_sacct("9", "9|TIMEOUT|n[1-2]\n9.batch|CANCELLED|n1\n").state == "TIMEOUT"
    assert slurm.parse_sacct("9", "") is None


def test_slurms_refusals_say_what_to_change(tmp_path):
    c = load_cluster(_write(tmp_path, {"slurm": {"nodes": 9, "partition": "big"}}))
    assert "no partition 'big'" in slurm.translate("sbatch: error: invalid partition specified: big", c.slurm)
    msg = slurm.translate("sbatch: error: Batch job submission failed: Requested node configuration is not "
                          "available", c.slurm)
    assert "cannot give 9 node(s)" in msg and "sinfo" in msg


def _view(state="running", ranks=("running", "running")):
    return RunView(state=state, ranks=[{"rank": i, "host": "n1", "state": s} for i, s in enumerate(ranks)])


@pytest.mark.parametrize("slurm_state, before, after", [
    ("TIMEOUT", "running", "timeout"),
    ("TIMEOUT", "stopped", "timeout"),      # the supervisors got SIGTERM from Slurm and said "stopped"
    ("TIMEOUT", "lost", "timeout"),         # ... or were killed before they could say anything
    ("NODE_FAIL", "running", "lost"),
    ("CANCELLED", "running", "stopped"),
    ("CANCELLED", "failed", "failed"),      # a run that ended on its own keeps its word
    ("COMPLETED", "succeeded", "succeeded"),
    ("RUNNING", "running", "running"),
])
def test_slurms_word_on_a_run_its_supervisors_could_not_finish(slurm_state, before, after):
    view = _view(before)
    slurm.apply(view, slurm.JobInfo("5", slurm_state))
    assert view.state == after and view.slurm == {"job_id": "5", "state": slurm_state, "reason": ""}
    if after != before:
        assert f"Slurm job 5 ended {slurm_state}" in view.message
        assert {r["state"] for r in view.ranks} == {after if after in ("timeout", "lost") else "stopped"}


@pytest.mark.parametrize("slurm_state, ends, after", [
    ("TIMEOUT", [(None, 15), (143, None)], "timeout"),   # the ranks got Slurm's SIGTERM before their supervisor did
    ("TIMEOUT", [(None, 15), (1, None)], "failed"),      # one failed on its own: the run's word stands
    ("CANCELLED", [(None, 15), (None, 15)], "failed"),   # scancel: not a limit Slurm reached
    ("NODE_FAIL", [(None, 15), (None, 15)], "failed"),
])
def test_ranks_killed_by_slurms_own_sigterm_are_its_time_limit(slurm_state, ends, after):
    view = RunView(state="failed", ranks=[{"rank": i, "host": "n1", "state": "failed", "exit_code": code, "signal": sig}
                                          for i, (code, sig) in enumerate(ends)])
    slurm.apply(view, slurm.JobInfo("5", slurm_state))
    assert view.state == after
    if after == "timeout":
        assert "Slurm job 5 ended TIMEOUT: its time limit was reached" in view.message


def test_a_time_limit_seen_while_the_job_is_still_completing_is_a_timeout():
    view = _view("stopped")
    slurm.apply(view, slurm.JobInfo("5", "COMPLETING", reason="TimeLimit"))
    assert view.state == "timeout"
