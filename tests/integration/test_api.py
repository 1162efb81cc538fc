"""The Python API (orchestrator.api, exported by the package): the same lifecycle as the CLI,
driven directly, never printing or exiting."""

from __future__ import annotations

from pathlib import Path

import pytest

import orchestrator as orch
from orchestrator.errors import PreflightFailed, SpecError, UsageError


def _cluster(tmp_path: Path, command: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text("inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 2}]}\n"
                 f"job: {{workdir: {tmp_path}/wd, launcher: ranktable, command: [sh, -c, '{command}']}}\n"
                 "checks: {skip: [stale]}\n")
    return p


class Recorder(orch.Events):
    def __init__(self):
        self.steps, self.out, self.warnings = [], {}, []

    def step(self, message):
        self.steps.append(message)

    def warning(self, message):
        self.warnings.append(message)

    def output(self, rank, data):
        self.out[rank] = self.out.get(rank, b"") + data


def test_up_logs_status_down_from_python(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _cluster(tmp_path, "echo hello $RANK_ID")
    cluster = orch.load("cluster.yaml")
    assert orch.plan(cluster).size == 2
    report = orch.check(cluster)
    assert report.ok, [r for r in report.results if r.status in ("fail", "error")]
    ev = Recorder()
    result = orch.up(cluster, events=ev, follow_rank=1)
    assert (result.state, result.exit_code) == ("succeeded", 0)
    assert any("checking" in s for s in ev.steps) and ev.out.get(1) == b"hello 1\n"
    assert not any(s.startswith(("syncing", "synced")) for s in ev.steps), ev.steps   # nothing to sync
    assert b"".join(orch.logs(result.run.id, rank=0)) == b"hello 0\n"
    assert b"".join(orch.logs(rank=None)) == b"[rank 0] hello 0\n[rank 1] hello 1\n"
    assert orch.status(result.run.id).state == "succeeded"
    # the record here, and (from a directory with none) the cluster file's hosts: the same verdict
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    here, there = orch.status(result.run.id), orch.status(root=elsewhere, cluster=cluster)
    assert (there.run_id, there.state) == (result.run.id, "succeeded")
    assert here.nothing_left and there.nothing_left
    done, failed, view = orch.down(result.run.id)
    assert failed == {} and view.state == "succeeded"
    assert capsys.readouterr().out == ""  # the API prints nothing


def test_failures_are_results_and_bad_input_raises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cluster = orch.load(_cluster(tmp_path, '[ "$RANK_ID" = 1 ] && exit 4; sleep 30'))
    result = orch.up(cluster, skip_checks=True, show_output=False)
    with pytest.raises(UsageError, match="ranks 0..1"):  # checked with or without output
        orch.up(cluster, follow_rank=2, show_output=False)
    assert (result.state, result.exit_code) == ("failed", 1)
    assert result.outcome.first_failure["rank"] == 1 and result.outcome.first_failure["exit_code"] == 4
    followed = orch.logs(result.run.id, rank=1, follow=True)  # as `orch logs --follow` exits 1
    assert b"".join(followed) == b"" and not followed.ok
    followed = orch.logs(result.run.id, rank=0, host="127.0.0.1", follow=True)  # stopped by fail-fast: not failed
    assert b"".join(followed) == b"" and followed.ok
    with pytest.raises(UsageError, match="numbered from 1"):
        orch.logs(result.run.id, attempt=0)
    with pytest.raises(UsageError, match=f"--attempt 2: run {result.run.id} had 1 attempt$"):
        orch.logs(result.run.id, attempt=2)   # ended: there will be none
    (tmp_path / "bad.yaml").write_text("inventory: {hosts: [{address: x}]}\njob: {workdir: rel, command: x}\n")
    with pytest.raises(SpecError, match="must be an absolute path"):
        orch.load(tmp_path / "bad.yaml")
    (tmp_path / "afile").write_text("")  # a workdir below a file: cannot be made
    (tmp_path / "nowrite.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local}]}\n"
        f"job: {{workdir: {tmp_path}/afile/wd, command: [\"true\"]}}\n")
    with pytest.raises(PreflightFailed) as exc:
        orch.up(orch.load(tmp_path / "nowrite.yaml"))
    assert not exc.value.report.ok  # the check results travel with the error
    assert exc.value.hint == "fix the problems above, or pass --skip-checks to launch anyway"
    (tmp_path / "nosync.yaml").write_text(   # --skip-checks would fail on it too: not offered
        "inventory: {hosts: [{address: 127.0.0.1, connection: local}]}\n"
        f"job: {{workdir: {tmp_path}/wd, command: [\"true\"], sync: [nope.py]}}\n")
    with pytest.raises(PreflightFailed) as exc:
        orch.up(orch.load(tmp_path / "nosync.yaml"))
    assert exc.value.hint == "fix the problems above"
    with pytest.raises(SpecError, match="'nope.py' does not exist"):
        orch.up(orch.load(tmp_path / "nosync.yaml"), skip_checks=True)


def test_a_synced_hostfile_is_left_out_for_orchs_own_and_said(tmp_path, monkeypatch):
    """A `hostfile` left in a synced `.` (from running mpirun by hand): the workdir's hostfile is
    orch's, the user's is not synced, and `orch up` says so. Before, both went in one stream on
    every `orch up` (the user's first, then orch's over it), one copy counted each time."""
    project = tmp_path / "project"   # the workdir is outside it
    project.mkdir()
    monkeypatch.chdir(project)
    (project / "hostfile").write_text("mine slots=9\n")
    (project / "cluster.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 1}]}\n"
        f"job: {{workdir: {tmp_path}/wd, launcher: mpirun, sync: [.], command: [cat, hostfile]}}\n"
        "checks: {skip: [stale]}\n")
    for n in range(2):
        ev = Recorder()
        result = orch.up(orch.load("cluster.yaml"), events=ev)
        assert (result.state, result.exit_code) == ("succeeded", 0)
        assert ev.warnings == ["job.sync: hostfile not synced: orch writes the launch's own file of that name "
                               "in job.workdir (to keep this quiet: rename yours, or leave it out of job.sync, or "
                               "add /hostfile to job.sync_exclude)"], ev.warnings
        assert ev.out[0].endswith(b"\n127.0.0.1 slots=1\n") and b"mine" not in ev.out[0]
        synced = [s for s in ev.steps if s.startswith("synced:")]
        assert synced == [f"synced: {1 - n} file copies, {n} already up to date"], ev.steps   # cluster.yaml
    assert (project / "hostfile").read_text() == "mine slots=9\n"
