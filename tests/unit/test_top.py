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


def test_orch_up_live_view_is_orch_tops_lines_under_the_counts_bounded_to_half_the_terminal():
    v = view(64, 8)
    v.progress["77"].update(total=200, step=200, rate=0.5)
    head = "orch: 512 running, 0/512 ranks exited, 12s"
    full = top.lines(v, NOW)
    assert top.panel(head, v, NOW, 40, 500) == [head] + full   # fits: the same lines as `orch top`
    for p in v.progress.values():   # 24 hosts straggling: a line each, far too many
        if p["rank"] >= 40 * 8:
            p.update(total=10, step=10, rate=0.1)
    full = top.lines(v, NOW)
    out = top.panel(head, v, NOW, 24, 80)
    assert len(full) > 24 and len(out) == 12, out
    assert out[:11] == [head] + [ln if len(ln) <= 79 else ln[:76] + "..." for ln in full[:10]]
    assert out[11] == f"... {len(full) - 10} more line(s): `orch top` shows them all"
    assert all(len(ln) <= 79 for ln in out)
    assert len(top.panel(head, v, NOW, 6, 80)) == 3     # a small terminal still gets the counts and more
    assert len(top.panel(head, v, NOW, 3, 80)) == 2     # but never all of its rows
    assert top.panel(head, v, NOW, 1, 80) == [head]
    assert top.panel(head, None, NOW, 24, 80) == [head]  # before the head's first word: the counts alone


def _events(monkeypatch, tty: bool, quiet: bool = False, term: str = "xterm", stdout=None, streams_output=True):
    import io
    import os
    import shutil
    import sys
    import time

    from orchestrator.cli import _CliEvents

    err, out = io.StringIO(), io.BytesIO()
    err.isatty = lambda: tty
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", stdout or io.TextIOWrapper(out))
    monkeypatch.setenv("TERM", term)
    monkeypatch.setattr(time, "time", lambda: NOW)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: os.terminal_size((100, 30)))
    return _CliEvents(quiet=quiet, streams_output=streams_output), err, out


def _run_through(ev):
    v = view(2, 2)
    ev.step("started run R1")
    ev.progress(4, 0, 4, 3.0, v)
    ev.output(0, b"epoch: 1, step: 5, loss is 0.5\npartial")
    ev.progress(4, 0, 4, 4.0, v)
    ev.output(0, b" line\n")
    ev.warning("something")
    ev.close()


def test_orch_up_on_a_terminal_keeps_the_table_under_the_rank_output(monkeypatch):
    from orchestrator import live

    ev, err, out = _events(monkeypatch, tty=True)
    _run_through(ev)
    assert out.getvalue() == b"epoch: 1, step: 5, loss is 0.5\npartial line\n"   # the rank's bytes, whole
    text = err.getvalue()
    panel = top.panel("orch: 4 running, 0/4 ranks exited, 4s", view(2, 2), NOW, 30, 100)
    assert live.draw(panel) in text and "rank 3 node002" in text
    # every draw is erased before anything else is written, and the last one stays
    assert text.count(live.SAVE) == text.count(live.ERASE) + 1 and text.endswith("\r\n")
    assert text.index("orch: warning: something") > text.rindex(live.ERASE)


def test_orch_up_in_a_pipe_or_quiet_or_dumb_terminal_prints_plain_lines(monkeypatch):
    for kw in ({"tty": False}, {"tty": True, "quiet": True}, {"tty": True, "term": "dumb"}):
        ev, err, out = _events(monkeypatch, **kw)
        _run_through(ev)
        # the warning is yellow on a terminal, as before; nothing else has a control code
        plain = err.getvalue().replace("\x1b[33morch: warning: something\x1b[0m", "orch: warning: something")
        assert "\x1b" not in plain and b"\x1b" not in out.getvalue(), kw
        if kw.get("quiet"):
            assert plain == "orch: warning: something\n" and out.getvalue() == b""
        else:   # no table, no counts: the lines as they were
            assert plain == "orch: started run R1\norch: warning: something\n", kw
            assert out.getvalue() == b"epoch: 1, step: 5, loss is 0.5\npartial line\n"


def test_orch_up_with_the_rank_output_into_a_pipe_has_no_live_view_unless_no_output_goes_there(monkeypatch):
    import os

    r, w = os.pipe()   # `orch up | tee log`: tee writes to the terminal too, out of orch's hands
    try:
        writer = os.fdopen(w, "w")
        ev, err, _ = _events(monkeypatch, tty=True, stdout=writer)
        _run_through(ev)
        writer.flush()
        assert os.read(r, 65536) == b"epoch: 1, step: 5, loss is 0.5\npartial line\n"
        assert "\x1b7" not in err.getvalue() and "rank 3 node002" not in err.getvalue()
        ev, err, _ = _events(monkeypatch, tty=True, stdout=writer, streams_output=False)   # --json
        ev.progress(4, 0, 4, 3.0, view(2, 2))
        assert "rank 3 node002" in err.getvalue()
    finally:
        writer.close()
        os.close(r)
