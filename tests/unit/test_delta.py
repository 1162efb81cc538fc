"""What the head pushes to watchers: a snapshot, then only what changed (agent/delta.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent import delta
from orchestrator.agent.delta import DeltaError, Follower, Publisher

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=3))
records = st.dictionaries(st.sampled_from(["state", "pid", "end"]), scalars, max_size=3)
docs = st.fixed_dictionaries({}, optional={
    "state": scalars, "message": scalars, "attempts": st.lists(records, max_size=3),
    "ranks": st.lists(records, min_size=0, max_size=6),
    "progress": st.dictionaries(st.sampled_from(["0", "1", "2"]), records, max_size=3),
    "load": st.dictionaries(st.sampled_from(["h1", "h2"]), records, max_size=2),
    "reached": st.one_of(st.none(), st.dictionaries(st.sampled_from(["h1", "h2"]), scalars, max_size=2))})


@settings(max_examples=400, deadline=None)
@given(st.lists(docs, min_size=1, max_size=6))
def test_a_watcher_that_applies_every_delta_has_the_heads_document(seq):
    pub = Publisher(seq[0])
    f = Follower()
    n, snap = pub.snapshot()
    f.snapshot(n, delta.copy(snap))
    for doc in seq[1:]:
        change = pub.next(doc)
        if change is not None:
            f.delta(*json.loads(json.dumps(change)))    # as it crosses the wire
        assert f.doc == doc


def test_one_rank_that_moved_of_8192_costs_one_rank_not_the_document():
    ranks = [{"rank": r, "host": "h%d" % (r // 8), "state": "running", "pid": 1000 + r, "end": None}
             for r in range(8192)]
    doc = {"state": "running", "ranks": ranks, "progress": {str(r): {"step": 10} for r in range(8192)}}
    pub = Publisher(doc)
    doc["ranks"][77] = dict(doc["ranks"][77], state="failed", end=5.0)
    doc["progress"]["5"] = {"step": 11}
    seq, d = pub.next(doc)
    assert seq == 1 and set(d) == {"ranks", "maps"} and list(d["ranks"]) == ["77"]
    assert d["maps"] == {"progress": {"set": {"5": {"step": 11}}, "del": []}}
    assert len(json.dumps(d)) < 200 < len(json.dumps(doc)) // 1000
    assert pub.next(doc) is None     # nothing changed: nothing sent


def test_deltas_out_of_order_or_before_a_snapshot_are_refused():
    f = Follower()
    with pytest.raises(DeltaError):
        f.delta(1, {"set": {"state": "x"}})
    f.snapshot(4, {"ranks": [{}]})
    with pytest.raises(DeltaError):
        f.delta(6, {"set": {"state": "x"}})
    for bad in ({"ranks": {"9": {}}}, {"ranks": {"x": {}}}, {"set": []}, {"maps": {"load": []}}):
        with pytest.raises(DeltaError):
            delta.apply({"ranks": [{}]}, bad)
    assert f.delta(5, {"set": {"state": "x"}})["state"] == "x"


def test_the_controllers_stream_applies_deltas_to_the_last_state():
    from orchestrator import supervisor
    got = []
    stream = supervisor.EventStream(lambda d: got.append(json.loads(json.dumps(d))), lambda *a: None)
    stream.write(b'D {"set":{"state":"lost"}}\n')           # before any state: nothing to apply it to
    stream.write(b'E {"state":"running","ranks":[{"state":"running"}]}\n')
    stream.write(b'D {"ranks":{"0":{"state":"failed"}},"set":{"state":"failed"}}\nD {not json}\n')
    assert got == [{"state": "running", "ranks": [{"state": "running"}]},
                   {"state": "failed", "ranks": [{"state": "failed"}]}]


def test_the_controllers_stream_passes_on_each_heartbeat():
    from orchestrator import supervisor
    got = []
    stream = supervisor.EventStream(lambda d: got.append("E"), lambda r, a, d: got.append(d),
                                    on_beat=lambda: got.append("H"))
    stream.write(b'H\nO 0 1 2\nH\nE {"state":"running"}\nH')   # a frame's bytes are data, not a beat
    stream.write(b'\n')
    assert got == ["H", b"H\n", "E", "H"]


def test_figures_go_out_every_second_for_a_small_run_less_often_for_a_large_one():
    assert [delta.figures_every(n) for n in (0, 1, 512, 1024, 2560, 8192)] == [1.0, 1.0, 1.0, 2.0, 5.0, 5.0]
    doc = {"state": "running", "ranks": [{"state": "running"}] * 1024, "progress": {"0": {"step": 1}}}
    assert Publisher(doc).every == 2.0 and Publisher({"ranks": []}).every == 1.0


def test_a_small_runs_figures_go_out_on_every_beat_even_a_little_early():
    """Every second up to 512 ranks: a heartbeat's publish a little less than 1 s after the last
    (the beat is ~1 s, and a change may have published between) still carries the figures."""
    doc = {"state": "running", "ranks": [{"state": "running"}] * 8, "progress": {"0": {"step": 0}}}
    pub = Publisher(doc)
    sent = []
    for i, t in enumerate((100.0, 100.95, 101.9, 102.93, 103.2)):
        doc["progress"]["0"] = {"step": i + 1}
        got = pub.next(doc, t)
        sent.append(got is not None)
    assert sent == [True, True, True, True, False]   # ...not twice in a third of a second


def test_figures_that_move_every_second_go_out_at_most_every_few_seconds():
    doc = {"state": "running", "ranks": [{"state": "running"}], "progress": {"0": {"step": 1}}}
    pub = Publisher(doc, every=delta.FIGURES_EVERY)
    f = Follower()
    f.snapshot(*pub.snapshot())
    f.doc = delta.copy(f.doc)
    t = 100.0
    doc["progress"]["0"] = {"step": 2}
    f.delta(*pub.next(doc, t))                      # the first change goes at once
    assert f.doc["progress"]["0"]["step"] == 2
    doc["progress"]["0"] = {"step": 3}
    assert pub.next(doc, t + 1) is None             # held back...
    doc["ranks"][0] = {"state": "failed"}
    f.delta(*pub.next(doc, t + 2))                  # ...a rank's state is not
    assert f.doc["ranks"][0]["state"] == "failed" and f.doc["progress"]["0"]["step"] == 2
    doc["progress"]["0"] = {"step": 4}
    f.delta(*pub.next(doc, t + delta.FIGURES_EVERY))
    assert f.doc == doc
