"""Run records (orchestrator/runs.py): the cluster text they keep has every secret masked and
stays valid YAML."""

from __future__ import annotations

import pytest
import yaml

from orchestrator import runs
from orchestrator.spec import load_cluster

HEAD = "inventory:\n  hosts: [{address: 10.0.0.1}]\njob:\n  workdir: /data/x\n  command: 'true'\n  env:\n"


def masked_env(tmp_path, text: str) -> dict:
    f = tmp_path / "cluster.yaml"
    f.write_text(text, newline="")
    masked = runs.mask_yaml(text, load_cluster(f).job)
    assert "S3cr3t" not in masked
    return yaml.safe_load(masked)["job"]["env"]


@pytest.mark.parametrize("br", ["\n", "\r", "\r\n", "\x85", "\u2028", "\u2029"])
@pytest.mark.parametrize("indicator", ["|", ">", "|+", ">-"])
def test_block_scalar_secret_ending_in_any_line_break(tmp_path, br, indicator):
    """A block scalar's node takes in the line breaks after it; each of YAML's five line break
    characters (U+0085 NEXT LINE found by the fuzz test) is put back as one, so the next key
    stays on its own line."""
    text = HEAD + f"    HF_TOKEN: {indicator}\n      S3cr3t-x{br}{br}    PLAIN: x\n"
    assert masked_env(tmp_path, text) == {"HF_TOKEN": runs.MASK, "PLAIN": "x"}


def test_anchored_secret_keeps_its_anchor(tmp_path):
    """An alias to a masked value stays defined (and shows MASK too); a tag is dropped."""
    text = HEAD + "    HF_TOKEN: !!str &tok S3cr3t-x\n    PLAIN: *tok\n"
    assert masked_env(tmp_path, text) == {"HF_TOKEN": runs.MASK, "PLAIN": runs.MASK}
    text = HEAD.replace("{address: 10.0.0.1}", "{address: 10.0.0.1, env: {A: &tok S3cr3t-x}}") + "    HF_TOKEN: *tok\n"
    assert masked_env(tmp_path, text) == {"HF_TOKEN": runs.MASK}


def test_other_spellings(tmp_path):
    """Double-quoted with escapes, single-quoted, a number: masked by their key."""
    text = HEAD + ("    HF_TOKEN: \"S3cr3t-\\x85\\N\"\n    DB_PASSWORD: 'S3cr3t-''q'''\n"
                   "    AWS_KEY: 123\n    PLAIN: plain\n")
    assert masked_env(tmp_path, text) == {"HF_TOKEN": runs.MASK, "DB_PASSWORD": runs.MASK, "AWS_KEY": runs.MASK,
                                          "PLAIN": "plain"}


def test_a_record_of_a_newer_format_names_the_orch_that_wrote_it(tmp_path):
    """Version skew: `orch status/logs/down` of a run recorded by a newer orch say, in one line,
    which version recorded it and what to do, instead of misreading it."""
    import json as _json

    import pytest as _pytest

    from orchestrator.errors import UsageError
    from orchestrator.runs import RUN_VERSION, RUNS_DIR, load_run

    d = tmp_path / RUNS_DIR / "20991231-000000-abcd"
    d.mkdir(parents=True)
    (d / "run.json").write_text(_json.dumps({"v": RUN_VERSION + 1, "orch": "7.0.0", "id": d.name, "started": 1}))
    with _pytest.raises(UsageError) as exc:
        load_run(cwd=tmp_path)
    assert "recorded by orch 7.0.0" in str(exc.value) and "orch 7.0.0 or newer" in exc.value.hint
    (d / "run.json").write_text(_json.dumps({"id": d.name, "started": 1, "name": "old"}))   # before versioning
    assert load_run(cwd=tmp_path).data["name"] == "old"


def test_only_a_durable_write_waits_for_the_disk(tmp_path, monkeypatch):
    """write_atomic: whole or not at all either way; fsync only when `durable` (the default: the
    record that ends a run), not for a save on the way to another (the start's)."""
    import os

    synced = []
    real = os.fsync
    monkeypatch.setattr(runs.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    runs.write_atomic(tmp_path / "a.json", "{}", 0o600)
    assert len(synced) == 1
    runs.write_atomic(tmp_path / "a.json", '{"b": 1}', 0o600, durable=False)
    assert len(synced) == 1 and (tmp_path / "a.json").read_text() == '{"b": 1}'
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]   # no temporary file left


def test_distribute_keeps_one_copy_of_each_rendered_file_here(tmp_path, monkeypatch):
    """The run directory here gets each rendered file once, not once per host that has it (a rank
    table is every host's: 128 durable writes of it at 128 hosts)."""
    from orchestrator import lifecycle, sync
    from orchestrator.fanout import Results
    from orchestrator.launchers import Launch
    from orchestrator.rankplan import make_plan
    from tests.unit.test_checks import cluster

    c = cluster(tmp_path, n=3, launcher="mpirun")
    written: list[str] = []

    class FakeRun:
        def write_file(self, name, text):
            written.append(name)

    monkeypatch.setattr(sync, "sync_hosts", lambda *a, **k: Results())
    files = {h.name: {"rank_table.json": b"{}", "x.sh": h.name.encode()} for h in c.hosts}
    launch = Launch({h.name: () for h in c.hosts}, files)
    lifecycle.Lifecycle(c, make_plan(c), FakeRun(), None).distribute(launch, [])  # type: ignore[arg-type]  # a stand-in run and no pool: sync is faked
    assert sorted(written) == ["rank_table.json", "x.sh"]


def test_meanwhile_runs_beside_the_caller_and_hands_back_what_it_raised():
    """lifecycle._meanwhile (the start's save of run.json, beside the members' start): it runs
    while the caller goes on, and what it raised is returned when waited for, not lost."""
    import threading

    from orchestrator import lifecycle
    from orchestrator.errors import LocalWriteError

    go, seen = threading.Event(), []
    wait = lifecycle._meanwhile(lambda: (go.wait(10), seen.append("saved"), "its value")[-1])
    assert seen == []            # still running: the caller is not held
    go.set()
    assert wait() == ("its value", None) and seen == ["saved"]

    def full():
        raise LocalWriteError("cannot write run.json: No space left on device")

    value, err = lifecycle._meanwhile(full)()
    assert value is None and isinstance(err, LocalWriteError) and "No space left" in str(err)


def test_the_latest_run_is_the_last_started_even_within_one_second(tmp_path):
    """Run ids have a second's resolution and a random tail: two runs started in one second (a
    fast `orch up` and the next) sort by that tail. The latest (`orch logs`, `status`, `down`
    without --run) is the one started last (its record's `started`), as runs.by_start orders them."""
    import json

    from orchestrator.runs import RUNS_DIR, by_start, load_run

    root = tmp_path / RUNS_DIR
    for run_id, started in (("20260101-000000-ffffff", 100.1), ("20260101-000000-000000", 100.7)):
        (root / run_id).mkdir(parents=True)
        (root / run_id / "run.json").write_text(json.dumps({"v": 1, "id": run_id, "started": started}))
    assert by_start(root) == ["20260101-000000-ffffff", "20260101-000000-000000"]
    assert load_run(cwd=tmp_path).id == "20260101-000000-000000"
