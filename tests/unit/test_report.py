"""orch report's page (orchestrator/report.py), pure: what each chart is made of."""

from __future__ import annotations

from orchestrator import report


def recs(n_ranks: int, steps: int) -> list[dict]:
    return [{"rank": r, "attempt": 1, "total": s, "step": s, "epoch": 1, "loss": 1.0 / s + r,
             "values": {"acc": s / 100}} for r in range(n_ranks) for s in range(1, steps + 1)]


def test_few_ranks_one_line_each_many_ranks_a_band():
    few = dict((fid, fig) for fid, _, fig in report.figures({}, recs(3, 5), 0.0))
    assert [t["name"] for t in few["loss"]["data"]] == ["rank 0", "rank 1", "rank 2"]
    assert few["loss"]["data"][1]["y"] == [1.0 / s + 1 for s in range(1, 6)]
    assert "metric-acc" in few
    many = dict((fid, fig) for fid, _, fig in report.figures({}, recs(100, 4), 0.0))
    assert [t["name"] for t in many["loss"]["data"]] == ["min", "median", "max"]
    assert many["loss"]["data"][0]["y"][0] == 1.0 and many["loss"]["data"][2]["y"][0] == 100.0


def test_history_gives_rates_and_load_over_time():
    hist = [{"t": 100.0 + 10 * i, "p": {"0": [i, 1.0, 2.0 + i], "1": [i, 1.0, 1.0]},
             "l": {"h1": [50.0 + i, 1000.0, None]}} for i in range(3)]
    figs = dict((fid, fig) for fid, _, fig in report.figures({}, [], 0.0, hist))
    assert figs["rate-time"]["data"][0]["x"] == [0.0, 10.0, 20.0] and figs["rate-time"]["data"][0]["y"] == [2, 3, 4]
    assert figs["load-time-cpu"]["data"][0]["y"] == [50, 51, 52] and "load-time-acc" not in figs


def test_the_page_is_self_contained_and_escapes_what_runs_printed():
    doc = {"state": "failed", "name": "x", "message": "<script>alert(1)</script>",
           "first_failure": {"rank": 0, "host": "h", "how": "exit code 3"},
           "attempts": [{"attempt": 1, "state": "failed", "start": 1.0, "end": 5.0}]}
    page = report.build("R1", doc, recs(2, 3), "tail </script><b>", "/*plotly*/ x = '</script>';", 10.0)
    assert page.count("<script>") == 2 and "<script>alert" not in page and "&lt;/script&gt;&lt;b&gt;" in page
    assert "src=" not in page and "http" not in page.split("<script>")[0]
    assert "'<\\/script>'" in page       # the library's own text cannot end its script early
