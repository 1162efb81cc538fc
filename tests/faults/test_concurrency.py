"""Scenario 10: two runs from one directory at once."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.support import leftovers, orch, run_ids, runs_dir, spawn_orch, wait_until, write_fault_cluster

pytestmark = pytest.mark.lab

SLEEPER = ["sh", "-c", "echo start $RANK_ID; exec sleep 60"]  # exec: no shell to say "Terminated"


@pytest.fixture(scope="module")
def clab(fx_lab):
    return fx_lab("c", 2)


def _by_file(cwd) -> dict[str, dict]:
    out = {}
    for rid in run_ids(cwd):
        rec = json.loads((runs_dir(cwd) / rid / "run.json").read_text())
        out[rec["cluster_file"].rsplit("/", 1)[1]] = rec
    return out


def test_two_runs_from_one_directory_stay_apart(clab, tmp_path):
    """Scenario 10. Two `orch up` started at the same moment from one directory (different
    workdirs) get separate run records that stay valid JSON throughout (a reader polling them
    never sees a torn or mixed record); `orch down --run A` stops exactly A's processes
    (B's keep running), A's `orch up` reports it was stopped by `orch down` (exit 130) and
    records that, then B is stopped the same way, leaving nothing."""
    for name in ("a", "b"):
        write_fault_cluster(clab, tmp_path, name=f"{name}.yaml", workdir=f"/data/fx-cc-{name}", launcher="ranktable",
                            command=SLEEPER)
    torn: list[str] = []
    stop_reading = threading.Event()

    def reader() -> None:  # hammer the records while both runs write them
        while not stop_reading.is_set():
            for rid in run_ids(tmp_path):
                try:
                    json.loads((runs_dir(tmp_path) / rid / "run.json").read_text())
                except ValueError as exc:
                    torn.append(f"{rid}: {exc}")
            time.sleep(0.01)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    procs = {n: spawn_orch("up", "-q", f"{n}.yaml", cwd=tmp_path) for n in ("a", "b")}
    try:
        assert wait_until(lambda: len(run_ids(tmp_path)) == 2 and all(
            r["state"] == "running" and r["procs"] for r in _by_file(tmp_path).values()), 60)
        recs = _by_file(tmp_path)
        a, b = recs["a.yaml"], recs["b.yaml"]
        assert a["id"] != b["id"]
        assert a["job"]["workdir"] == "/data/fx-cc-a" and b["job"]["workdir"] == "/data/fx-cc-b"
        # the ranks themselves (`sleep`): a run's helpers come and go while it runs
        assert wait_until(lambda: len(leftovers(a["id"], "sleep")) == 4 and len(leftovers(b["id"], "sleep")) == 4, 30)
        b_before = sorted(leftovers(b["id"], "sleep"))
        down = orch("down", "--run", a["id"], cwd=tmp_path, check_rc=0)
        assert leftovers(a["id"]) == []
        assert sorted(leftovers(b["id"], "sleep")) == b_before, "orch down --run A touched run B"
        assert procs["a"].wait(30) == 130, procs["a"].stderr.read().decode()
        assert "stopped by `orch down`" in procs["a"].stderr.read().decode()
        st = json.loads(orch("status", "--json", "--run", b["id"], cwd=tmp_path, check_rc=0).stdout)
        assert [r["state"] for r in st["ranks"]] == ["running"] * 4, st
        assert procs["b"].poll() is None
        orch("down", "--run", b["id"], cwd=tmp_path, check_rc=0)
        assert procs["b"].wait(30) == 130
    finally:
        stop_reading.set()
        for p in procs.values():
            p.kill()
    t.join(5)
    assert torn == []
    recs = _by_file(tmp_path)
    for name, rec in recs.items():
        assert rec["state"] == "stopped" and rec["message"] == "stopped by `orch down`", (name, rec["message"])
        logs = runs_dir(tmp_path) / rec["id"] / "logs"
        assert sorted(p.name for p in logs.iterdir()) == [f"rank.{r}" for r in range(4)]
        for r in range(4):
            assert (logs / f"rank.{r}" / "stdout").read_bytes() == f"start {r}\n".encode()
    assert leftovers(a["id"]) == [] and leftovers(b["id"]) == []
    assert "records the outcome" in down.stderr.decode()
