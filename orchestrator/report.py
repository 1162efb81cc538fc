"""`orch report`: one self-contained HTML page of a recorded run, that opens offline.

What it shows, from what the controller keeps (`.orch/runs/<id>/`): the run's timeline (its
attempts, how each ended, the first failure), loss and every other metric per rank over steps
(read from the gathered logs with the hosts' own parser, agent/metrics.py, and kept beside them as
logs/metrics.jsonl), the steps each rank did and its last steps/s with the stragglers marked, each
host's load as last sampled, and the first failure with its log tail.

The charts are plotly.js, as the `plotly` Python package ships it (plotly.offline.get_plotlyjs):
embedded in the page, no CDN, nothing copied into this repository. `build()` is pure (data in,
HTML out); `write()` reads the run's files and writes the page atomically.
"""

from __future__ import annotations

import html
import json
import statistics
import time
from pathlib import Path
from typing import Sequence

from .agent import metrics
from .errors import OrchError, UsageError
from .runs import write_atomic
from .hostlayout import run_dir
from .transport import Pool
from . import top
from .runstate import RunView

MAX_TRACES = 64    # per-rank lines drawn one by one; more ranks: min / median / max per step


def rank_logs(run) -> list[tuple[int, int, Path]]:
    """(rank, attempt, path) of every gathered log of the run."""
    out = []
    for attempt in range(1, run.attempt + 1):
        for r in range(len(run.data.get("ranks") or []) or _plan_size(run)):
            p = run.local_log(r, attempt)
            if p.exists():
                out.append((r, attempt, p))
    return out


def _plan_size(run) -> int:
    return len((run.data.get("plan") or {}).get("ranks") or [])


def series(run, user: dict | None = None) -> list[dict]:
    """Every progress record of every gathered log: {"rank", "attempt", **record}."""
    out = []
    for rank, attempt, path in rank_logs(run):
        with open(path, "rb") as fh:
            for rec in metrics.records(fh, user):
                out.append({"rank": rank, "attempt": attempt, **rec})
    return out


def write_metrics(run, recs: list[dict]) -> Path:
    """logs/metrics.jsonl: one progress record a line."""

    path = run.logs_dir / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in recs), 0o600 if run.secret else 0o644)
    return path


def fetch_history(run) -> tuple[list[dict], str | None]:
    """The head's history.jsonl (agent/history.py): what is new of it brought here (one round trip
    to the launch host), then read. ([line], why it could not be brought, or None)."""

    local = run.dir / "history.jsonl"
    why = None
    try:
        cluster = run.cluster()
        host = run.plan().launch_host
        with Pool(cluster) as pool:
            pool[host].get(f"{run_dir(cluster, run.id)}/history.jsonl", local,
                           offset=local.stat().st_size if local.exists() else 0)
    except (OrchError, OSError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    out = []
    try:
        with open(local, "rb") as fh:
            for line in fh:
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue    # a line cut by a full disk, or being written
                if isinstance(doc, dict) and _num(doc.get("t")) is not None:
                    out.append(doc)
    except OSError:
        pass
    return out, why


def _over_time(hist: list[dict], part: str, col: int, label: str) -> list[dict]:
    """Traces of one figure over time from the history (seconds since its first line)."""
    t0 = hist[0]["t"]
    by: dict = {}
    for h in hist:
        for k, vals in (h.get(part) or {}).items():
            v = _num(vals[col]) if isinstance(vals, list) and len(vals) > col else None
            if v is not None:
                by.setdefault(int(k) if part == "p" and k.isdigit() else k, []).append((h["t"] - t0, v))
    return _traces(by, label)


def _traces(by: dict, label: str) -> list[dict]:
    """{rank or host: [(x, y)]} -> plotly traces: one each when few, else min / median / max at each x."""
    if len(by) <= MAX_TRACES:
        return [{"type": "scatter", "mode": "lines+markers", "name": f"{label} {k}".strip(),
                 "x": [p[0] for p in pts], "y": [p[1] for p in pts], "marker": {"size": 4}}
                for k, pts in sorted(by.items())]
    at: dict[float, list[float]] = {}
    for pts in by.values():
        for x, y in pts:
            at.setdefault(x, []).append(y)
    xs = sorted(at)
    return [{"type": "scatter", "mode": "lines+markers", "name": name, "x": xs, "y": [fn(at[x]) for x in xs],
             "marker": {"size": 4}} for name, fn in (("min", min), ("median", statistics.median), ("max", max))]


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lines(recs: list[dict], key) -> list[dict]:
    """Traces of one figure over steps, per rank."""
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for r in recs:
        v = _num(key(r))
        if v is not None:
            by_rank.setdefault(r["rank"], []).append((r["total"], v))
    return _traces(by_rank, "rank")


def figures(run_doc: dict, recs: list[dict], now: float, hist: Sequence[dict] = ()) -> list[tuple[str, str, dict]]:
    """(id, title, plotly figure) of each chart of the page."""

    figs: list[tuple[str, str, dict]] = []
    # the timeline: each attempt from its start to its end
    atts = [a for a in run_doc.get("attempts") or [] if _num(a.get("start")) is not None]
    if atts:
        t0 = min(a["start"] for a in atts)
        bars = {"type": "bar", "orientation": "h", "name": "attempts",
                "y": [f"attempt {a['attempt']}" for a in atts],
                "x": [max(0.1, (a.get("end") or now) - a["start"]) for a in atts],
                "base": [a["start"] - t0 for a in atts], "text": [a.get("state") for a in atts],
                "hovertext": [(a.get("message") or "")[:300] for a in atts],
                "marker": {"color": [_COLOR.get(a.get("state"), "#888") for a in atts]}}
        figs.append(("timeline", "Timeline: attempts (seconds since the first started)",
                     {"data": [bars], "layout": {"xaxis": {"title": "s"}, "height": 120 + 40 * len(atts)}}))
    if recs:
        figs.append(("loss", "Loss per rank over steps", {"data": _lines(recs, lambda r: r.get("loss")),
                                                           "layout": {"xaxis": {"title": "steps"}}}))
        names = sorted({k for r in recs for k in (r.get("values") or {})})[:12]
        for n in names:
            figs.append((f"metric-{n}", f"{n} per rank over steps",
                         {"data": _lines(recs, lambda r, n=n: (r.get("values") or {}).get(n)),
                          "layout": {"xaxis": {"title": "steps"}}}))
    # steps and steps/s per rank, the stragglers in red (as `orch top` marks them)
    progress = run_doc.get("progress") or {}
    ranks = run_doc.get("ranks") or []
    if progress or recs:
        last: dict[int, float] = {}
        for r in recs:
            last[r["rank"]] = r["total"]
        view = RunView(state=run_doc.get("state") or "?", ranks=[dict(r) for r in ranks],
                       progress={str(k): dict(v) for k, v in progress.items()})
        lag = top.stragglers([dict(r, state="running") for r in ranks], view.progress, now) if progress else {}
        xs = sorted(set(last) | {int(k) for k in progress})
        steps = [(progress.get(str(k)) or {}).get("total", last.get(k)) for k in xs]
        figs.append(("steps", "Steps done per rank (stragglers in red)", {"data": [{
            "type": "bar", "name": "steps", "x": [f"rank {k}" for k in xs], "y": steps,
            "hovertext": [lag.get(k) or "" for k in xs],
            "marker": {"color": ["#d62728" if k in lag else "#1f77b4" for k in xs]}}], "layout": {}}))
        rates = [(progress.get(str(k)) or {}).get("rate") for k in xs]
        if any(_num(v) is not None for v in rates):
            figs.append(("rate", "Steps per second per rank, last measured (stragglers in red)", {"data": [{
                "type": "bar", "name": "steps/s", "x": [f"rank {k}" for k in xs], "y": rates,
                "marker": {"color": ["#d62728" if k in lag else "#2ca02c" for k in xs]}}], "layout": {}}))
    hist = list(hist)
    if hist:
        rate = _over_time(hist, "p", 2, "rank")
        if rate:
            figs.append(("rate-time", "Steps per second per rank over time (s since the first sample)",
                         {"data": rate, "layout": {"xaxis": {"title": "s"}}}))
        for col, key, title in ((0, "cpu", "CPU of the run's processes per host over time (% of one core)"),
                                (2, "acc", "Accelerator use per host over time (%)")):
            traces = _over_time(hist, "l", col, "")
            if traces:
                figs.append((f"load-time-{key}", title, {"data": traces, "layout": {"xaxis": {"title": "s"}}}))
    load = run_doc.get("load") or {}
    if load:
        hosts = sorted(load)
        data = [{"type": "bar", "name": label, "x": hosts, "y": [load[h].get(key) for h in hosts]}
                for key, label in (("cpu", "CPU of the run's processes (% of one core)"),
                                   ("host_mem_pct", "host memory used (%)"), ("acc_util", "accelerator use (%)"))
                if any(_num(load[h].get(key)) is not None for h in hosts)]
        if data:
            figs.append(("load", "Host load, last sampled", {"data": data, "layout": {"barmode": "group"}}))
    return figs


_COLOR = {"succeeded": "#2ca02c", "running": "#1f77b4", "failed": "#d62728", "lost": "#9467bd",
          "stalled": "#ff7f0e", "timeout": "#8c564b", "stopped": "#7f7f7f", "interrupted": "#7f7f7f"}


def build(run_id: str, run_doc: dict, recs: list[dict], tail: str, plotly_js: str, now: float,
          hist: Sequence[dict] = (), hist_why: str | None = None) -> str:
    """The page: every chart, the first failure and its log tail; plotly.js inside."""
    figs = figures(run_doc, recs, now, hist)
    js = plotly_js.replace("</script", "<\\/script")
    ff = run_doc.get("first_failure")
    e = html.escape
    parts = [f"<h1>run {e(run_id)} ({e(str(run_doc.get('name') or ''))}): {e(str(run_doc.get('state')))}</h1>",
             f"<p>{e(str(run_doc.get('message') or ''))}</p>"]
    if ff:
        parts.append(f"<h2>First failure</h2><p>rank {e(str(ff.get('rank')))} on {e(str(ff.get('host')))}: "
                     f"{e(str(ff.get('how') or ''))} (attempt {e(str(ff.get('attempt') or 1))})</p>")
        if tail:
            parts.append(f"<pre class=tail>{e(tail)}</pre>")
    if hist_why:
        parts.append(f"<p>The run's history could not be brought from its launch host ({e(hist_why)}): the "
                     "charts over time show what was here.</p>")
    if not figs:
        parts.append("<p>No progress found in the gathered logs (no line matched the built-in patterns or "
                     "job.metrics).</p>")
    for fid, title, _ in figs:
        parts.append(f"<h2>{e(title)}</h2><div class=chart id=\"{e(fid)}\"></div>")
    specs = json.dumps([{"id": fid, "data": fig["data"], "layout": dict(fig.get("layout") or {},
                                                                         margin={"t": 20})}
                        for fid, _, fig in figs], allow_nan=False).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>orch run "
            f"{e(run_id)}</title>\n<style>body{{font-family:sans-serif;margin:2em}}.chart{{min-height:300px}}"
            "pre.tail{background:#f4f4f4;padding:1em;overflow:auto}</style>\n"
            f"<script>{js}</script>\n</head><body>\n"
            + "\n".join(parts)
            + f"\n<script>\nfor (const c of {specs}) {{ Plotly.newPlot(c.id, c.data, c.layout, "
              "{staticPlot: false, displaylogo: false}); }\n</script>\n</body></html>\n")


def plotly_js() -> str:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise UsageError("orch report draws its charts with plotly.js, which the `plotly` package ships: "
                         "pip install plotly, in orch's environment (from a checkout of orch: pip install -e '.[report]')") from None
    return get_plotlyjs()


def write(run, out: Path | None = None) -> tuple[Path, Path]:
    """The run's page (default .orch/runs/<id>/report.html) and logs/metrics.jsonl."""

    js = plotly_js()
    user = (run.data.get("job") or {}).get("metrics") or None
    recs = series(run, user)
    mpath = write_metrics(run, recs)
    ff = run.data.get("first_failure") or {}
    tail = run.log_tail(int(ff["rank"]), int(ff.get("attempt") or run.attempt), 30) \
        if isinstance(ff.get("rank"), int) else ""
    hist, why = fetch_history(run)
    page = build(run.id, run.data, recs, tail, js, time.time(), hist, why)
    dest = Path(out) if out else run.dir / "report.html"

    write_atomic(dest, page, 0o600 if run.secret else 0o644)
    return dest, mpath
