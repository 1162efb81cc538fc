"""`orch top`: a run's progress at a glance, from the head's document (runstate.RunView with
each rank's progress, agent/metrics.py, and each host's load). Pure: the CLI fetches and prints.

One line per rank when the run has at most PER_RANK ranks; else one line per group of hosts
that are alike (same state, same straggler mark), folded (`node[01-64]`, hostsets.fold) with the
range of their figures, the worst group first. Stragglers: a running rank whose steps lag the
others' (behind the median by more than LAG_STEPS and LAG_SHARE of it) and that is not keeping
pace (its steps/s under SLOW of the median: one that only started late is not marked), or whose
output has stopped for SILENT seconds while most others wrote within the last SILENT / 3.
"""

from __future__ import annotations

import statistics
from typing import Any

from .hostsets import fold

PER_RANK = 16
LAG_STEPS = 3
LAG_SHARE = 0.1
SILENT = 30.0
SLOW = 0.8

# worst first
_ORDER = {"failed": 0, "lost": 1, "unknown": 2, "straggler": 3, "orphaned": 4, "stopped": 5, "pending": 6,
          "running": 7, "exited": 8}


def stragglers(ranks: list[dict], progress: dict[str, dict], now: float) -> dict[int, str]:
    """{rank: why} of the running ranks that lag or have gone quiet while the others go on."""
    running = [r for r in ranks if r.get("state") == "running"]
    prog = {r["rank"]: progress.get(str(r["rank"])) or {} for r in running}
    out: dict[int, str] = {}
    totals = {k: p["total"] for k, p in prog.items() if isinstance(p.get("total"), (int, float))}
    rates = {k: p["rate"] for k, p in prog.items() if isinstance(p.get("rate"), (int, float))}
    med_rate = statistics.median(rates.values()) if rates else None
    if len(totals) >= 2:
        med = statistics.median(totals.values())
        for k, t in totals.items():
            pace = rates.get(k)
            keeping_up = pace is not None and med_rate and pace >= SLOW * med_rate
            if med - t > max(LAG_STEPS, LAG_SHARE * med) and not keeping_up:
                out[k] = f"lagging: {t:g} steps, the others {med:g}" + (
                    f" ({pace:.3g} steps/s, the others {med_rate:.3g})" if pace is not None and med_rate else "")
    quiet = {k: now - p["out"] for k, p in prog.items() if isinstance(p.get("out"), (int, float))}
    if len(quiet) >= 2:
        fresh = sum(1 for v in quiet.values() if v < SILENT / 3)
        for k, q in quiet.items():   # q >= SILENT: this rank is not among the fresh ones
            if q >= SILENT and fresh * 2 > len(quiet) - 1:
                out.setdefault(k, f"no output for {q:.0f}s while the others go on")
    return out


def rows(view: Any, now: float) -> list[dict]:
    """One record per rank: its state and figures, and why it is a straggler (None if not)."""
    lag = stragglers(view.ranks, view.progress, now)
    out = []
    for r in view.ranks:
        p = view.progress.get(str(r["rank"])) or {}
        out.append({"rank": r["rank"], "host": r["host"], "state": r["state"], "step": p.get("step"),
                    "epoch": p.get("epoch"), "loss": p.get("loss"), "steps": p.get("total"), "rate": p.get("rate"),
                    "since": round(now - p["out"], 1) if isinstance(p.get("out"), (int, float)) else None,
                    "values": p.get("values") or {}, "straggler": lag.get(r["rank"])})
    return out


def _kind(row: dict) -> str:
    state = str(row["state"]).split(" ")[0]
    return "straggler" if row["straggler"] and state == "running" else state


def _span(values: list, fmt: str) -> str:
    vs = [v for v in values if isinstance(v, (int, float))]
    words = sorted({v for v in values if isinstance(v, str)})
    if not vs:
        return "/".join(words) or "-"
    lo, hi = fmt.format(min(vs)), fmt.format(max(vs))
    return (lo if lo == hi else f"{lo}-{hi}") + ("/" + "/".join(words) if words else "")


def _load(view: Any, hosts: list[str]) -> str:
    cpu = [view.load[h].get("cpu") for h in hosts if h in view.load]
    mem = [view.load[h].get("mem_mib") for h in hosts if h in view.load]
    acc = [view.load[h].get("acc_util") for h in hosts if h in view.load]
    parts = []
    if any(isinstance(v, (int, float)) for v in cpu):
        parts.append(f"cpu {_span(cpu, '{:.0f}')}%")
    if any(isinstance(v, (int, float)) for v in mem):
        parts.append(f"mem {_span(mem, '{:.0f}')} MiB")
    if any(isinstance(v, (int, float)) for v in acc):
        parts.append(f"acc {_span(acc, '{:.0f}')}%")
    return "  ".join(parts)


def _line(label: str, kind: str, rs: list[dict], load: str, width: int) -> str:
    bits = [f"{label:<{width}}", f"{kind:<9}",
            f"step {_span([r['step'] for r in rs], '{:g}')}",
            f"loss {_span([r['loss'] for r in rs], '{:.4g}')}",
            f"{_span([r['rate'] for r in rs], '{:.3g}')} steps/s",
            f"out {_span([r['since'] for r in rs], '{:.0f}')}s ago"]
    if load:
        bits.append(load)
    why = sorted({r["straggler"] for r in rs if r["straggler"]})
    if why:
        bits.append("STRAGGLER: " + (why[0] if len(why) == 1 else f"{why[0]} (+{len(why) - 1} more)"))
    return "  ".join(bits)


def lines(view: Any, now: float, run_id: str | None = None) -> list[str]:
    """What `orch top` prints: a title, then one line per rank (few) or per folded group of hosts."""
    rs = rows(view, now)
    title = f"run {run_id or view.run_id or '?'}: {view.state}" + (f", attempt {view.attempt}" if view.attempt > 1
                                                                     else "")
    n_lag = sum(1 for r in rs if r["straggler"])
    title += f", {len(rs)} ranks" + (f", {n_lag} straggling" if n_lag else "")
    out = [title]
    if len(rs) <= PER_RANK:
        width = max([len(f"rank {r['rank']} {r['host']}") for r in rs] + [4])
        for r in sorted(rs, key=lambda r: (_ORDER.get(_kind(r), 9), r["rank"])):
            out.append(_line(f"rank {r['rank']} {r['host']}", _kind(r), [r], _load(view, [r["host"]]), width))
        return out
    by_host: dict[str, list[dict]] = {}
    for r in rs:
        by_host.setdefault(r["host"], []).append(r)
    groups: dict[str, list[str]] = {}
    for host, hr in by_host.items():
        worst = min((_kind(r) for r in hr), key=lambda k: _ORDER.get(k, 9))
        groups.setdefault(worst, []).append(host)
    labelled = [(fold(hosts), kind, hosts) for kind, hosts in groups.items()]
    width = max(len(label) for label, _, _ in labelled)
    for label, kind, hosts in sorted(labelled, key=lambda x: (_ORDER.get(x[1], 9), x[0])):
        hr = [r for h in hosts for r in by_host[h]]
        if kind == "straggler":   # each straggling host on its own line: they are what to look at
            for h in hosts:
                out.append(_line(h, kind, by_host[h], _load(view, [h]), width))
            continue
        out.append(_line(label, kind, hr, _load(view, hosts), width))
    return out


def as_json(view: Any, now: float) -> dict:
    """`orch top --json`: the run's state, each rank's figures and straggler mark, each host's load."""
    return {"run": view.run_id, "state": view.state, "attempt": view.attempt, "message": view.message,
            "ranks": rows(view, now), "load": view.load}


def panel(head: str, view: Any | None, now: float, height: int, width: int) -> list[str]:
    """The live view `orch up` keeps under the followed rank's output on a terminal of `height`
    rows and `width` columns: `head` (the run's counts), then what `orch top` prints (lines()), at
    most half the terminal's height (3 lines at least, yet a row fewer than the terminal has), each
    line cut to fit one row. lines() puts the worst first: what is left out is the end, counted in
    a last line."""
    out = [head] + (lines(view, now) if view is not None and view.ranks else [])
    limit = min(max(3, height // 2), height - 1)   # the rank's own row stays on screen
    if len(out) > limit:
        more = f"... {len(out) - limit + 1} more line(s): `orch top` shows them all"
        out = out[:limit - 1] + [more] if limit > 1 else [head]
    cut = max(10, width - 1)   # not the last column: a full row would wrap on some terminals
    return [ln if len(ln) <= cut else ln[:cut - 3] + "..." for ln in out]
