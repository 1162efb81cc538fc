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
        self.steps, self.out = [], {}

    def step(self, message):
        self.steps.append(message)

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
    assert b"".join(orch.logs(result.run.id, rank=0)) == b"hello 0\n"
    assert b"".join(orch.logs(rank=None)) == b"[rank 0] hello 0\n[rank 1] hello 1\n"
    assert orch.status(result.run.id).state == "succeeded"
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
