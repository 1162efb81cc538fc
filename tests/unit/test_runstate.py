"""What `orch status` makes of the hosts' state documents (runstate.merge): live processes are
never shown ended, another orch's document is named, not guessed."""

from __future__ import annotations

from orchestrator import runstate
from orchestrator.agent.protocol import STATE_VERSION


def head_doc(state="running", **kw):
    ranks = [{"rank": r, "host": "h1" if r < 2 else "h2", "device": r % 2, "pid": 100 + r, "state": "running",
              "exit_code": None, "signal": None, "attempt": 1} for r in range(4)]
    return {"v": STATE_VERSION, "orch": "0.1.0", "run": "R1", "state": state, "head": "h1", "attempt": 1,
            "ranks": ranks, "lost": [], "message": "", "agent_alive": True, **kw}


def test_a_crashed_heads_live_ranks_are_orphaned_with_the_stop_hint_never_stopped():
    doc = head_doc(agent_alive=False, alive_ranks=[0, 1])
    view = runstate.merge("h1", {"h1": doc, "h2": {"role": "member", "attempt": 1, "ranks": [], "alive_ranks": []}},
                          {}, [], "R1")
    assert view.state == "lost"
    assert [r["state"] for r in view.ranks] == ["orphaned", "orphaned", "stopped", "stopped"]
    assert "ranks 0-1 on h1 still running after the run ended: stop them with `orch down --run R1`" in view.message
    assert runstate.EXIT[view.state] == 1


def test_alive_ranks_of_a_running_run_are_running():
    doc = head_doc(alive_ranks=[1])
    doc["ranks"][1]["state"] = "stopped"   # whatever the record says, the process lives
    view = runstate.merge("h1", {"h1": doc}, {}, [], "R1")
    assert view.ranks[1]["state"] == "running"


def test_a_document_of_a_newer_format_names_the_version_that_started_it():
    doc = head_doc(v=STATE_VERSION + 1, orch="9.9.0", state="hibernating")
    view = runstate.merge("h1", {"h1": doc}, {}, [], "R1")
    assert "started by orch 9.9.0" in view.message and "with orch 9.9.0 or newer" in view.message
    assert "\n" not in view.message
    assert view.state == "hibernating"   # its own word, not a guess, and never `unknown`...
    doc = head_doc(v=STATE_VERSION + 1, orch="9.9.0", state="succeeded")
    view = runstate.from_head(doc)
    assert view.state == "succeeded" and "9.9.0" in view.message  # ...a known one is kept


def test_documents_before_versioning_read_as_before():
    doc = head_doc(state="succeeded")
    del doc["v"], doc["orch"]
    view = runstate.merge("h1", {"h1": doc}, {}, [], "R1")
    assert view.state == "succeeded" and view.message == ""


def test_exit_codes_cover_every_run_state():
    from orchestrator.agent.states import RunState

    assert set(runstate.EXIT) == {s.value for s in RunState}
    assert runstate.EXIT["stopped"] == 4 and runstate.EXIT["timeout"] == 1 and runstate.EXIT["running"] == 0


def test_the_hosts_rank_folding_says_what_the_controllers_does():
    """The hosts fold rank numbers without ClusterShell (stdlib only); the controller's RangeSet
    must give the same text, or the same run would be described two ways."""
    from ClusterShell.RangeSet import RangeSet

    from orchestrator.agent.states import rank_ranges

    for ranks in ([0], [3, 1, 2], [0, 1, 2, 5, 7, 8, 9], list(range(0, 100, 3)), [10, 11, 13]):
        folded = str(RangeSet.fromlist([str(r) for r in ranks]))
        word = "rank" if len(ranks) == 1 else "ranks"
        assert rank_ranges(ranks) == f"{word} {folded}"


def test_the_launch_host_unreachable_the_other_hosts_own_records_of_their_ranks_are_shown():
    """The launch host cut off: the run's state is unknown (the head holds it), but each other
    host's record of its own ranks (lost, once it lost the head) is evidence, shown as it is."""
    plan = [{"rank": r, "host": "h1" if r < 2 else "h2", "device": r % 2} for r in range(4)]
    member = {"role": "member", "attempt": 1, "alive_ranks": [],
              "ranks": [{"rank": r, "host": "h2", "device": r % 2, "pid": 100 + r, "state": "lost",
                         "exit_code": None, "signal": 15, "attempt": 1} for r in (2, 3)]}
    view = runstate.merge("h1", {"h2": member}, {"h1": "timed out after 2s connecting to h1:22"}, plan, "R1")
    assert view.state == "unknown" and "the launch host h1 cannot be reached" in view.message
    assert [r["state"] for r in view.ranks] == ["unknown (host unreachable)"] * 2 + ["lost", "lost"]
    assert runstate.EXIT.get(view.state, 1) == 1


def test_every_view_names_its_run():
    """api.up's outcome.view and api.status's view alike: RunView.run_id is the run's id."""
    assert runstate.from_head(head_doc()).run_id == "R1"
    assert runstate.merge("h1", {}, {"h1": "unreachable"}, [], "R2").run_id == "R2"


def test_an_ended_run_says_nothing_is_left_only_when_every_host_says_so():
    """Each host of an ended run: asked now, its `live_pids`; not asked, its supervisor's word to
    the head as it ended (`left_nothing`). Every host's word: the view says nothing is left; a
    host unreachable, not covered, or with a live process: it does not."""
    ended = [dict(r, state="exited", exit_code=0) for r in head_doc()["ranks"]]
    doc = head_doc("succeeded", agent_alive=False, ranks=ended, alive_ranks=[], live_pids=[], left_nothing=["h2"],
                   message="all 4 ranks exited 0")
    view = runstate.merge("h1", {"h1": doc}, {}, [], "R1", ["h1", "h2"])
    assert view.nothing_left and view.message == "all 4 ranks exited 0" and view.to_dict()["nothing_left"]
    member = {"role": "member", "attempt": 1, "ranks": [], "alive_ranks": [], "live_pids": []}
    for docs, unreachable, hosts in (({"h1": doc}, {}, ["h1", "h2", "h3"]),                  # h3 said nothing
                                     ({"h1": dict(doc, left_nothing=[])}, {}, ["h1", "h2"]),
                                     ({"h1": doc}, {"h2": "timed out"}, ["h1", "h2"]),
                                     ({"h1": dict(doc, live_pids=[7])}, {}, ["h1", "h2"]),   # a daemon it left
                                     ({"h1": doc, "h3": dict(member, live_pids=[9])}, {}, ["h1", "h2", "h3"]),
                                     ({"h1": head_doc(left_nothing=["h2"], live_pids=[])}, {}, ["h1", "h2"])):
        assert not runstate.merge("h1", docs, unreachable, [], "R1", hosts).nothing_left
    assert runstate.merge("h1", {"h1": doc, "h3": member}, {}, [], "R1", ["h1", "h2", "h3"]).nothing_left
    assert not runstate.merge("h1", {"h1": doc}, {}, [], "R1").nothing_left   # not asked to tell


def test_status_of_a_cluster_file_covers_the_runs_own_hosts_not_only_the_files():
    """`orch status FILE` (no record here): nothing_left is said only when the head's word covers
    every host of the run as its document names them, not just the cluster file's hosts now (a
    host taken out of the file since, a spare that took a host's place)."""
    from orchestrator.recorded import run_hosts

    doc = {"v": STATE_VERSION, "run": "R", "state": "succeeded", "head": "a", "attempt": 1, "ended": 2.0,
           "hosts": ["a", "c"], "spares": ["d"], "spares_lost": ["f"], "replaced": [{"host": "c", "by": "d"}],
           "ranks": [{"rank": 0, "host": "a", "state": "exited", "exit_code": 0}, {"rank": 1, "host": "e"}],
           "live_pids": [], "role": "head", "left_nothing": ["b"]}
    assert run_hosts(["a", "b"], doc) == ["a", "b", "c", "d", "f", "e"]
    assert run_hosts(["a"], {}) == ["a"]
    view = runstate.merge("a", {"a": doc}, {}, [], "R", run_hosts(["a", "b"], doc))
    assert not view.nothing_left   # c, d, e, f said nothing
    doc["left_nothing"] = ["b", "c", "d", "e", "f"]
    assert runstate.merge("a", {"a": doc}, {}, [], "R", run_hosts(["a", "b"], doc)).nothing_left
