"""`orch top` (orchestrator/top.py): stragglers, folding at 1,024 ranks, plain lines."""

from __future__ import annotations

import json

from orchestrator import top
from orchestrator.runstate import RunView

NOW = 10_000.0


def view(n_hosts: int, per_host: int, progress=None, load=None, states=None) -> RunView:
    ranks = [{"rank": h * per_host + i, "host": f"node{h + 1:03d}", "device": i, "pid": 100 + i,
              "state": (states or {}).get(h * per_host + i, "running"), "exit_code": None, "signal": None}
             for h in range(n_hosts) for i in range(per_host)]
    prog = progress if progress is not None else {
        str(r["rank"]): {"rank": r["rank"], "step": 500, "epoch": 1, "loss": 0.5, "total": 500, "rate": 2.0,
                         "out": NOW - 1} for r in ranks}
    return RunView(state="running", attempt=1, ranks=ranks, progress=prog, load=load or {}, run_id="R1")


def test_a_rank_that_lags_is_a_straggler_and_comes_first():
    v = view(2, 2)
    v.progress["3"].update(total=200, step=200, rate=0.5)
    out = top.lines(v, NOW)
    assert out[0] == "run R1: running, 4 ranks, 1 straggling"
    assert out[1].startswith("rank 3 node002") and "STRAGGLER: lagging: 200 steps, the others 500 (0.5 steps/s, " \
        "the others 2)" in out[1]
    assert not any("STRAGGLER" in ln for ln in out[2:])


def test_a_rank_that_started_late_but_keeps_pace_is_not_a_straggler():
    v = view(2, 2)
    v.progress["3"].update(total=200, step=200, rate=1.9)
    assert top.stragglers(v.ranks, v.progress, NOW) == {}
    v.progress["3"].update(rate=None)          # no rate yet: the steps alone say it
    assert "lagging" in top.stragglers(v.ranks, v.progress, NOW)[3]


def test_a_rank_whose_output_stopped_while_the_others_go_on_is_a_straggler():
    v = view(2, 2)
    v.progress["1"]["out"] = NOW - 120
    marks = {r["rank"]: r["straggler"] for r in top.rows(v, NOW)}
    assert marks == {0: None, 1: "no output for 120s while the others go on", 2: None, 3: None}
    for p in v.progress.values():   # all quiet: a stall (the head's business), nobody singled out
        p["out"] = NOW - 120
    assert not any(r["straggler"] for r in top.rows(v, NOW))


def test_ranks_close_together_are_not_stragglers():
    v = view(4, 2)
    for k, p in v.progress.items():
        p["total"] = 500 - int(k) % 3
    assert top.stragglers(v.ranks, v.progress, NOW) == {}


def test_1024_ranks_fold_into_a_few_lines_worst_first():
    v = view(128, 8, states={17: "failed"}, load={f"node{h:03d}": {"cpu": 700.0 + h, "mem_mib": 9000.0}
                                                 for h in range(1, 129)})
    v.progress["77"].update(total=10, step=10, rate=0.1)      # node010 lags
    out = top.lines(v, NOW)
    assert len(out) == 4, out
    assert out[1].startswith("node003 ") and " failed " in out[1]
    assert out[2].startswith("node010 ") and "STRAGGLER" in out[2]
    assert out[3].startswith("node[001-002,004-009,011-128] ") and "running" in out[3]
    assert "step 500 " in out[3] and "cpu 701-828%" in out[3] and "mem 9000 MiB" in out[3]


def test_plain_lines_no_control_codes_and_json():
    v = view(2, 1, progress={})
    out = top.lines(v, NOW)
    assert all("\x1b" not in ln for ln in out) and "step -" in out[1]
    doc = json.loads(json.dumps(top.as_json(view(1, 2), NOW)))
    assert doc["ranks"][0] == {"rank": 0, "host": "node001", "state": "running", "step": 500, "epoch": 1,
                               "loss": 0.5, "steps": 500, "rate": 2.0, "since": 1.0, "values": {},
                               "straggler": None}


def test_orch_up_status_line_summarises_steps_loss_and_stragglers():
    v = view(64, 8)
    v.progress["77"].update(total=200, step=200, rate=0.5)
    v.progress["78"].update(total=210, step=210, rate=0.4)
    assert top.summary(v, NOW) == "step 200-500, loss 0.5, 2 straggling (ranks 77-78 on node010)"
    assert top.summary(view(2, 2, progress={}), NOW) == ""


def test_orch_up_status_line_on_a_terminal_carries_the_summary_and_fits_one_line(monkeypatch, capsys):
    import shutil
    import sys

    from orchestrator.cli import _CliEvents

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: __import__("os").terminal_size((60, 20)))
    ev = _CliEvents(quiet=False)
    ev.progress(16, 0, 16, 12.0, "step 200-500, loss 0.5, 2 straggling (ranks 77-78 on node010)")
    err = capsys.readouterr().err
    assert err.startswith("\r\x1b[2Korch: 16 running, 0/16 ranks exited, 12s; step 200-500")
    assert len(err) - len("\r\x1b[2Korch: ") <= 52
    ev.progress(16, 0, 16, 12.0, "step 200-500, loss 0.5, 2 straggling (ranks 77-78 on node010)")
    assert capsys.readouterr().err == ""   # the same line is not printed again
