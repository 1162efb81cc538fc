"""What the head pushes to watchers: the run's document once (a `state` snapshot, on connect),
then only what changed (`delta`), so a run of 8,192 ranks costs its watchers the ranks that moved,
not the whole document every second.

A delta holds, each part present only when not empty:
    set   {key: value}             top-level keys whose value changed (or appeared)
    del   [key]                    top-level keys gone
    ranks {index: rank record}     entries of doc["ranks"] that changed (same length; else in `set`)
    maps  {key: {set, del}}        keys of the per-rank / per-host maps (MAPS) that changed
and `seq`: the snapshot is seq N, each delta N+1, N+2...; a watcher applies delta N+1 only on a
document of seq N (apply() raises otherwise, and the watcher connects again for a snapshot).
Pure; stdlib only.
"""

from __future__ import annotations

from . import jsonc
from .layout import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

MAPS = ("progress", "load", "reached")
FIGURES = ("progress", "load")   # what moves all the time: sent at most every figures_every() seconds
FIGURES_EVERY = 5.0   # the most: a run of FIGURES_RANKS x 5 ranks or more
FIGURES_RANKS = 512   # up to this many ranks, every second (a live view moves once a second)
FIGURES_SLACK = 0.5   # s: a publish this much early still sends them (the head's beats are 1 s apart, give or take)


def figures_every(ranks):
    """Seconds between two sends of the figures to watchers, for a run of `ranks` ranks: 1 up to
    FIGURES_RANKS, growing with the ranks to FIGURES_EVERY (a publish of 8,192 ranks' figures is
    ~34 ms of the head's CPU and 0.2 MB/s to each watcher every 5 s; bench_watch.py). Every 5 s
    for a small run, the live view's progress jumped and a rank printing every second showed as
    silent for up to 5 s."""
    return min(FIGURES_EVERY, max(1.0, ranks / FIGURES_RANKS))
_MISSING = object()


class DeltaError(ValueError):
    """A delta that does not fit the document it is applied to."""


def copy(doc):
    """A deep copy of a JSON document (what the watchers were last sent)."""
    return jsonc.loads(jsonc.dumps(doc))


def diff(old, new, skip=()):
    """{...} of what turns `old` into `new` ({} when nothing changed); keys in `skip` not compared."""
    out: dict[str, Any] = {}
    sets: dict[str, Any] = {}
    maps: dict[str, Any] = {}
    for k, v in new.items():
        if k in skip:
            continue
        o = old.get(k, _MISSING)
        if k == "ranks" and isinstance(v, list) and isinstance(o, list) and len(o) == len(v):
            ch = {str(i): r for i, (a, r) in enumerate(zip(o, v)) if a != r}
            if ch:
                out["ranks"] = ch
        elif k in MAPS and isinstance(v, dict) and isinstance(o, dict):
            ch = {kk: vv for kk, vv in v.items() if o.get(kk, _MISSING) != vv}
            gone = [kk for kk in o if kk not in v]
            if ch or gone:
                maps[k] = {"set": ch, "del": gone}
        elif o is _MISSING or o != v:
            sets[k] = v
    gone = [k for k in old if k not in new and k not in skip]
    if sets:
        out["set"] = sets
    if gone:
        out["del"] = gone
    if maps:
        out["maps"] = maps
    return out


def apply(doc, d):
    """Apply delta `d` to `doc` in place (and return it). DeltaError when it does not fit."""
    if not isinstance(d, dict):
        raise DeltaError("a delta must be an object")
    sets, gone, ranks, maps = d.get("set", {}), d.get("del", []), d.get("ranks", {}), d.get("maps", {})
    if not (isinstance(sets, dict) and isinstance(gone, list) and isinstance(ranks, dict) and isinstance(maps, dict)):
        raise DeltaError("a delta's set, del, ranks and maps must be an object, a list, an object, an object")
    for k in gone:
        if isinstance(k, str):
            doc.pop(k, None)
    doc.update(sets)
    if ranks:
        have = doc.get("ranks")
        if not isinstance(have, list):
            raise DeltaError("a delta of ranks for a document without ranks")
        for i, r in ranks.items():
            if not i.isdigit() or int(i) >= len(have) or not isinstance(r, dict):
                raise DeltaError("a delta of rank index %r of %d" % (i[:20], len(have)))
            have[int(i)] = r
    for k, m in maps.items():
        if not isinstance(m, dict) or not isinstance(m.get("set", {}), dict) or not isinstance(m.get("del", []), list):
            raise DeltaError("a delta of map %r must hold set {} and del []" % str(k)[:20])
        target = doc.get(k)
        if not isinstance(target, dict):
            target = doc[k] = {}
        for kk in m.get("del", []):
            if isinstance(kk, str):
                target.pop(kk, None)
        target.update(m.get("set", {}))
    return doc


class Publisher:
    """The head's side: what watchers have been sent. `next(doc)` -> the delta to send (None when
    nothing changed); `snapshot()` -> (seq, document) for a watcher that connects now: the
    document the others have, so the next delta fits both."""

    def __init__(self, doc, every=None):
        self.sent = copy(doc)
        self.seq = 0
        self.figures_at = None
        self.every = figures_every(len(doc.get("ranks") or ())) if every is None else every

    def next(self, doc, now=None):
        """With `now`, the figures (FIGURES: each rank's progress, each host's load, which change
        every second on a training run) go out at most every `every` seconds (figures_every); the
        rest at once."""
        hold = now is not None and self.figures_at is not None and now - self.figures_at < self.every - FIGURES_SLACK
        d = diff(self.sent, doc, FIGURES if hold else ())
        if now is not None and not hold and any(k in d.get("maps", {}) for k in FIGURES):
            self.figures_at = now
        if not d:
            return None
        apply(self.sent, copy(d))   # what the watchers now have (held figures stay as they were)
        self.seq += 1
        return self.seq, d

    def snapshot(self):
        return self.seq, self.sent


class Follower:
    """A watcher's side: the document, kept by snapshots and deltas. `on(kind, fields)` -> the
    document after it (DeltaError for a delta out of sequence or before any snapshot)."""

    def __init__(self):
        self.doc: dict[str, Any] | None = None
        self.seq = -1   # none yet: the snapshot sets it

    def on(self, t, f):
        """A parsed `state` or `delta` message (protocol.TO_WATCHER) -> the document after it."""
        if t == "state":
            return self.snapshot(f["seq"], f["state"])
        return self.delta(f["seq"], f["delta"])

    def snapshot(self, seq, doc):
        self.doc, self.seq = doc, seq
        return doc

    def delta(self, seq, d):
        if self.doc is None:
            raise DeltaError("a delta before the snapshot")
        if seq != self.seq + 1:
            raise DeltaError("delta %d after %d" % (seq, self.seq))
        apply(self.doc, d)
        self.seq = seq
        return self.doc
