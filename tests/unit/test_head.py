"""The head's decisions (orchestrator/agent/head.py), driven without a process or a socket:
events in, actions out. Each duty of the run's supervisor is held to its promise here."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent import head as H
from orchestrator.agent import protocol
from orchestrator.agent.states import (ATTEMPT_TRANSITIONS, RANK_TRANSITIONS, RUN_TRANSITIONS, RankState,
                                       RunState)

T0 = 1_700_000_000.0


def make(hosts=("a", "b"), per_host=2, **cfg) -> H.Head:
    ranks = [{"rank": i * per_host + j, "host": h, "device": j, "pid": None, "state": "pending", "exit_code": None,
              "signal": None, "start": None, "end": None, "attempt": 0}
             for i, h in enumerate(hosts) for j in range(per_host)]
    base = {"run_id": "r1", "host": hosts[0], "hosts": list(hosts), "all_ranks": ranks, "on_failure": "stop",
            "restarts": 0, "restart_delay": 0, "stall_timeout": None, "timeout": None, "grace": 5,
            "lost_after": 10, "join_timeout": 60, "launcher": "ranktable", "head_addresses": ["10.0.0.1", "10.1.0.1"]}
    base.update(cfg)
    return H.Head(base, T0)


def rep(head, host, states, attempt=None, out=None, live=None, procs=()):
    """A host's report: states is {rank: (state, exit_code, signal, end)}."""
    attempt = head.doc["attempt"] if attempt is None else attempt
    ranks = []
    for r in head.doc["ranks"]:
        if r["host"] != host:
            continue
        stt, code, sig, end = states.get(r["rank"], ("running", None, None, None))
        ranks.append({"rank": r["rank"], "host": host, "device": r["device"], "pid": 100 + r["rank"], "state": stt,
                      "exit_code": code, "signal": sig, "start": T0, "end": end, "attempt": attempt})
    if live is None:
        live = any(x["end"] is None for x in ranks)
    return H.reported(host, {"host": host, "attempt": attempt, "ranks": ranks, "procs": list(procs),
                             "out": T0 if out is None else out, "stopping": None, "live": live})


def running(hosts=("a", "b"), **cfg):
    """A head whose members have all joined and whose attempt 1 is running."""
    head = make(hosts, **cfg)
    events = [H.joined(h, "10.1.0.1") for h in hosts[1:]]
    _, actions = H.decide(head, events, T0 + 1)
    assert ("start", 1, "10.1.0.1") in starts(actions)
    H.decide(head, [rep(head, h, {}) for h in hosts], T0 + 1.5)
    assert head.phase == H.Phase.RUN and head.state == RunState.RUNNING
    return head


def kinds(actions):
    return [a[0] for a in actions]


def starts(actions):
    """("start", attempt, head address) of each start action (its setup left out)."""
    return [a[:3] for a in actions if a[0] == "start"]


def finish_stopping(head, t, hosts=("a", "b"), procs=None):
    """Every host reports nothing live any more: the attempt's stop completes. `procs`: {host:
    the processes its report still lists}."""
    if not head.stop_sent:
        _, a1 = H.decide(head, [], t)           # the stop goes out
        assert "stop" in kinds(a1)
    evs = []
    for h in hosts:
        prev = head.hosts[h].report
        states = {}
        for r in head.doc["ranks"]:
            if r["host"] == h:
                states[r["rank"]] = ((r["state"], r["exit_code"], r["signal"], r["end"]) if r["end"] is not None
                                     else ("stopped", None, 15, t))
        evs.append(rep(head, h, states, live=False, out=prev["out"] if prev else T0, procs=(procs or {}).get(h, ())))
    return H.decide(head, evs, t + 0.5)


# --------------------------------------------------------------------------- joining

def test_every_member_joined_starts_attempt_one_on_the_address_most_reached():
    head = make(("a", "b", "c"))
    _, actions = H.decide(head, [H.joined("b", "10.0.0.1")], T0 + 0.5)
    assert "start" not in kinds(actions)
    _, actions = H.decide(head, [H.joined("c", "10.1.0.1")], T0 + 0.6)
    # a tie: the preferred (first advertised) address
    assert ("start", 1, "10.0.0.1") in starts(actions) and head.doc["reached"] == {"b": "10.0.0.1", "c": "10.1.0.1"}


def test_a_second_join_for_a_joined_host_is_refused():
    head = make()
    assert head.can_join("b") and not head.can_join("a") and not head.can_join("zz")
    H.decide(head, [H.joined("b", "10.0.0.1")], T0 + 1)
    assert not head.can_join("b")


def test_a_member_that_never_joins_makes_the_run_lost_naming_it_and_the_addresses_tried():
    head = make(("a", "b", "c"), lost_after=100)
    H.decide(head, [H.joined("b", "10.0.0.1")], T0 + 1)
    _, actions = H.decide(head, [], T0 + 61)
    assert head.state == RunState.LOST and head.doc["lost"] == ["c"]
    assert "c never reached" in head.doc["message"] and "10.0.0.1, 10.1.0.1" in head.doc["message"]
    assert ("exit", RunState.LOST) in actions and "start" not in kinds(actions)


def test_stop_before_the_start_ends_stopped_and_starts_nothing():
    head = make()
    _, actions = H.decide(head, [H.stop_asked("orch down")], T0 + 1)
    assert head.state == RunState.STOPPED and "start" not in kinds(actions)
    assert "orch down" in head.doc["message"]


# --------------------------------------------------------------------------- fail-fast

def test_fail_fast_names_the_first_rank_to_fail_not_the_lowest():
    head = running()
    # rank 0 failed later than rank 3, whose host reported after a's
    H.decide(head, [rep(head, "a", {0: ("failed", 1, None, T0 + 10.5), 1: ("exited", 0, None, T0 + 2)}),
                    rep(head, "b", {2: ("failed", 1, None, T0 + 11), 3: ("failed", None, 9, T0 + 9.25)})], T0 + 12)
    ff = head.doc["first_failure"]
    assert (ff["rank"], ff["host"], ff["how"]) == (3, "b", "killed by signal 9 (SIGKILL)")
    assert head.phase == H.Phase.STOPPING and "rank 3 on b (device 1) failed" in head.doc["message"]


def test_fail_fast_stops_every_host_as_soon_as_one_rank_fails():
    head = running()
    _, actions = H.decide(head, [rep(head, "b", {2: ("failed", 3, None, T0 + 5)})], T0 + 5.1)
    assert head.doc["attempts"][-1]["state"] == RunState.FAILED
    [stop] = [a for a in actions if a[0] == "stop"]   # in the same decision
    assert "rank 2 on b" in stop[1]
    _, actions = finish_stopping(head, T0 + 6)
    assert head.state == RunState.FAILED and ("exit", RunState.FAILED) in actions
    # its siblings, killed by TERM afterwards, are stopped, not failed
    assert [r["state"] for r in head.doc["ranks"]] == ["stopped", "stopped", "failed", "stopped"]


def test_siblings_killed_by_the_launcher_after_the_first_failure_count_as_stopped():
    head = running()
    H.decide(head, [rep(head, "a", {0: ("failed", None, 15, T0 + 6), 1: ("failed", None, 9, T0 + 6.2)}),
                    rep(head, "b", {2: ("failed", 2, None, T0 + 5), 3: ("failed", None, 15, T0 + 4)})], T0 + 7)
    finish_stopping(head, T0 + 8)
    # rank 3 died of SIGTERM BEFORE rank 2 failed: it is the first failure
    assert head.doc["first_failure"]["rank"] == 3
    assert {r["rank"]: r["state"] for r in head.doc["ranks"]} == {0: "stopped", 1: "stopped", 2: "failed",
                                                                  3: "failed"}


def test_two_hosts_ranks_failing_too_close_to_order_are_both_named():
    """Rank 2 on b ended 50 ms before rank 0 on a, by each host's clock: b's is named first,
    and the message says the two are too close to order (the clocks of two hosts are not that
    close); a rank that failed long after, or by the launcher's TERM/KILL, is not mentioned."""
    head = running()
    H.decide(head, [rep(head, "a", {0: ("failed", 1, None, T0 + 5.05)}),
                    rep(head, "b", {2: ("failed", 7, None, T0 + 5.0)})], T0 + 5.1)
    finish_stopping(head, T0 + 6)
    assert head.doc["first_failure"]["rank"] == 2
    assert head.doc["message"] == ("rank 2 on b (device 0) failed: exit code 7; rank 0 on a failed 0.05s later "
                                   "(exit code 1), by each host's own clock: too close to tell which failed first")
    head = running()
    H.decide(head, [rep(head, "a", {0: ("failed", 1, None, T0 + 7)}),
                    rep(head, "b", {2: ("failed", 7, None, T0 + 5.0), 3: ("failed", None, 15, T0 + 5.1)})], T0 + 7.1)
    finish_stopping(head, T0 + 8)
    assert head.doc["message"] == "rank 2 on b (device 0) failed: exit code 7"


def test_on_failure_continue_lets_the_others_finish_then_fails():
    head = running(on_failure="continue")
    _, actions = H.decide(head, [rep(head, "b", {2: ("failed", 3, None, T0 + 5)})], T0 + 5.1)
    assert head.phase == H.Phase.RUN and "stop" not in kinds(actions)
    H.decide(head, [rep(head, "a", {0: ("exited", 0, None, T0 + 8), 1: ("exited", 0, None, T0 + 8)}),
                    rep(head, "b", {2: ("failed", 3, None, T0 + 5), 3: ("exited", 0, None, T0 + 9)})], T0 + 9.5)
    assert head.phase == H.Phase.STOPPING and head.doc["first_failure"]["rank"] == 2
    finish_stopping(head, T0 + 10)
    assert head.state == RunState.FAILED


def test_every_rank_exited_zero_is_success():
    head = running()
    _, actions = H.decide(head, [rep(head, h, {r: ("exited", 0, None, T0 + 3) for r in range(4)}, live=False)
                                 for h in ("a", "b")], T0 + 3.5)
    finish_stopping(head, T0 + 4)
    assert head.state == RunState.SUCCEEDED and head.doc["message"] == "all 4 ranks exited 0"


def _last_report(head, host, left_nothing, attempt=None):
    """A member's last report (server.member_tick): its ranks ended, and whether nothing of the run lives there."""
    ev = rep(head, host, {r["rank"]: (r["state"], r["exit_code"], r["signal"], r["end"] or T0 + 5)
                          for r in head.doc["ranks"] if r["host"] == host}, attempt=attempt, live=False)
    return H.reported(host, dict(ev[2], left_nothing=left_nothing))


def test_the_head_records_which_members_left_nothing_of_the_run_running():
    """A member's last report says nothing of the run is left on its host: the head records that
    host (after the end too, and whatever attempt the report is of), once; a member that did not
    say so (a crash, a process that outlived its KILL, a lost host) is not recorded, so `orch
    status` still asks it."""
    head = running(hosts=("a", "b", "c"))
    H.decide(head, [rep(head, h, {r: ("exited", 0, None, T0 + 3) for r in range(6)}, live=False)
                    for h in ("a", "b", "c")], T0 + 3.5)
    finish_stopping(head, T0 + 4, hosts=("a", "b", "c"))
    assert head.state == RunState.SUCCEEDED and head.doc["left_nothing"] == []
    _, actions = H.decide(head, [_last_report(head, "b", True), _last_report(head, "c", False)], T0 + 5)
    assert head.doc["left_nothing"] == ["b"] and "publish" in kinds(actions)
    _, actions = H.decide(head, [_last_report(head, "b", True, attempt=0)], T0 + 5.5)
    assert head.doc["left_nothing"] == ["b"] and "publish" not in kinds(actions)
    H.decide(head, [rep(head, "c", {}, live=False)], T0 + 6)   # an ordinary report says nothing of it
    assert head.doc["left_nothing"] == ["b"]


def test_a_report_saying_left_nothing_is_checked_and_an_older_one_without_it_reads_false():
    ev = rep(make(), "b", {})
    assert protocol.parse_report(dict(ev[2], left_nothing=True))["left_nothing"] is True
    assert protocol.parse_report(ev[2])["left_nothing"] is False
    with pytest.raises(protocol.ProtocolError, match="left_nothing"):
        protocol.parse_report(dict(ev[2], left_nothing="yes"))


def test_a_failed_launcher_is_named_after_its_ranks_had_their_grace():
    head = running(launcher="mpirun")
    mpirun = {"key": "mpirun", "rank": None, "pid": 50, "exit_code": 1, "signal": None, "start": T0, "end": T0 + 4}
    H.decide(head, [rep(head, "a", {}, procs=[mpirun])], T0 + 4.1)
    assert head.phase == H.Phase.RUN      # its ranks may still report
    _, actions = H.decide(head, [], T0 + 4.1 + H.LAUNCHER_REPORT_GRACE + 0.1)
    assert head.phase == H.Phase.STOPPING and head.doc["message"].startswith("mpirun on a failed: exit code 1")
    assert ("launcher_failed", "mpirun", "a") in actions


def test_a_rank_killed_by_sigterm_orch_never_sent_waits_for_the_launcher_whose_failure_leads():
    """mpirun that cannot launch what a rank asked for (MPI Spawn of a missing program) aborts
    the job: its ranks die of SIGTERM, then it exits 132. The run's message is mpirun's failure
    (the server quotes its words), not "rank 1 ... killed by signal 15 (SIGTERM)"."""
    head = running(launcher="mpirun")
    mpirun = {"key": "mpirun", "rank": None, "pid": 50, "exit_code": None, "signal": None, "start": T0, "end": None}
    H.decide(head, [rep(head, "a", {}, procs=[mpirun])], T0 + 2)
    _, actions = H.decide(head, [rep(head, "b", {2: ("failed", None, 15, T0 + 4)})], T0 + 4.1)
    assert head.phase == H.Phase.RUN and "stop" not in kinds(actions)    # mpirun's word is awaited
    ended = dict(mpirun, exit_code=132, end=T0 + 4.3)
    _, actions = H.decide(head, [rep(head, "a", {0: ("failed", None, 15, T0 + 4.2),
                                                 1: ("failed", None, 15, T0 + 4.2)}, procs=[ended]),
                                 rep(head, "b", {2: ("failed", None, 15, T0 + 4), 3: ("failed", None, 15, T0 + 4.2)})],
                          T0 + 4.4)
    assert ("launcher_failed", "mpirun", "a") in actions
    head.outcome = (head.outcome[0], head.outcome[1] + " (its own output: ...)")   # as the server adds
    H.decide(head, [], T0 + 4.5)
    assert head.state == RunState.FAILED, head.doc["message"]
    assert head.doc["message"] == "mpirun on a failed: exit code 132 (its own output: ...)"
    assert head.doc["message"].startswith("mpirun on a failed: exit code 132"), head.doc["message"]
    assert "SIGTERM" not in head.doc["message"] and head.doc["first_failure"] is None


def test_a_sigterm_rank_is_named_when_the_launcher_does_not_fail_within_the_grace():
    head = running(launcher="mpirun")
    mpirun = {"key": "mpirun", "rank": None, "pid": 50, "exit_code": None, "signal": None, "start": T0, "end": None}
    H.decide(head, [rep(head, "a", {}, procs=[mpirun]), rep(head, "b", {2: ("failed", None, 15, T0 + 4)})], T0 + 4.1)
    assert head.phase == H.Phase.RUN
    H.decide(head, [], T0 + 4 + H.LAUNCHER_REPORT_GRACE + 0.1)
    assert head.phase == H.Phase.STOPPING and head.doc["first_failure"]["rank"] == 2
    assert "killed by signal 15 (SIGTERM)" in head.doc["message"]


def test_a_rank_killed_by_sigkill_is_named_at_once_though_a_launcher_runs():
    head = running(launcher="mpirun")
    mpirun = {"key": "mpirun", "rank": None, "pid": 50, "exit_code": None, "signal": None, "start": T0, "end": None}
    H.decide(head, [rep(head, "a", {}, procs=[mpirun]), rep(head, "b", {2: ("failed", None, 9, T0 + 4)})], T0 + 4.1)
    assert head.phase == H.Phase.STOPPING and head.doc["first_failure"]["rank"] == 2


# --------------------------------------------------------------------------- lost hosts

def test_a_member_whose_connection_closes_is_lost_and_the_run_ends_lost():
    head = running()
    _, actions = H.decide(head, [H.gone("b")], T0 + 3)
    assert head.doc["lost"] == ["b"] and "lost contact with host b (ranks 2-3): the connection to its supervisor " \
        "closed." in head.doc["message"]
    assert "stop" in kinds(actions)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 3.2), 1: ("stopped", None, 15, T0 + 3.2)},
                        live=False)], T0 + 3.5)
    assert head.state == RunState.LOST
    assert [r["state"] for r in head.doc["ranks"]] == ["stopped", "stopped", "lost", "lost"]


def test_a_silent_member_is_lost_after_lost_after_seconds_not_before():
    head = running(lost_after=10)
    H.decide(head, [rep(head, "a", {})], T0 + 11)
    assert head.doc["lost"] == []
    H.decide(head, [rep(head, "a", {})], T0 + 11.6)
    assert head.doc["lost"] == ["b"] and "its supervisor was silent for 10.1s" in head.doc["message"]


def test_a_member_killed_with_all_its_processes_is_named_by_its_closed_connection_not_silence():
    """kill -9 of every process on a host: its connection closes at once; the message says so,
    not that it was silent (the words come from what was seen)."""
    head = running(("a", "b", "c"), lost_after=20)
    H.decide(head, [rep(head, "a", {}), rep(head, "c", {}), H.gone("b")], T0 + 3)
    assert head.doc["lost"] == ["b"]
    assert "lost contact with host b (ranks 2-3): the connection to its supervisor closed." in head.doc["message"]
    assert "silent" not in head.doc["message"] and "network" not in head.doc["message"]


def test_the_launch_host_hearing_from_no_other_host_says_it_lost_its_own_network():
    """The launch host cut off: every other host falls silent at once (its connection still
    open). The head says it heard from none of them, not that it lost some of them."""
    hosts = ("a", "b", "c", "d")
    head = running(hosts, lost_after=10)
    H.decide(head, [rep(head, "b", {}), rep(head, "c", {})], T0 + 2.0)
    H.decide(head, [rep(head, "d", {})], T0 + 2.6)
    H.decide(head, [rep(head, "a", {})], T0 + 12.1)   # its own reports go on
    assert head.doc["lost"] == ["b", "c", "d"]
    msg = head.doc["message"]
    assert msg.startswith("the launch host a heard nothing from any of the 3 other hosts for 9.5s or more"), msg
    assert "lost contact with host" not in msg and "ranks 2-7" in msg


def test_one_silent_host_among_others_that_answer_is_that_hosts_silence():
    hosts = ("a", "b", "c", "d")
    head = running(hosts, lost_after=10)
    H.decide(head, [rep(head, "b", {}), rep(head, "c", {})], T0 + 11.6)
    assert head.doc["lost"] == ["d"]
    assert "lost contact with host d (ranks 6-7): its supervisor was silent for 10.1s" in head.doc["message"]
    assert "network" not in head.doc["message"]


# --------------------------------------------------------------------------- stalls, time-out, restarts

def test_silent_ranks_are_a_stall_stacks_first_then_stopped():
    head = running(stall_timeout=30)
    _, actions = H.decide(head, [rep(head, "a", {}, out=T0 + 20), rep(head, "b", {}, out=T0 + 10)], T0 + 45)
    assert head.phase == H.Phase.RUN
    _, actions = H.decide(head, [], T0 + 50.5)
    assert kinds(actions)[0] == "dump" and head.doc["attempts"][-1]["state"] == RunState.STALLED
    _, actions = H.decide(head, [], T0 + 51)   # the stacks get 2 s before the stop
    assert "stop" not in kinds(actions)
    finish_stopping(head, T0 + 52.6)
    assert head.state == RunState.STALLED


def test_timeout_counts_from_the_runs_start():
    head = running(timeout=100, lost_after=1000)
    H.decide(head, [], T0 + 99)
    assert head.phase == H.Phase.RUN
    H.decide(head, [], T0 + 100.5)
    assert head.doc["attempts"][-1]["state"] == RunState.TIMEOUT and "job.timeout = 100s" in head.doc["message"]


def test_a_failed_attempt_restarts_after_the_delay_while_restarts_remain():
    head = running(restarts=1, restart_delay=5)
    H.decide(head, [rep(head, "b", {3: ("failed", 1, None, T0 + 4)})], T0 + 4)
    finish_stopping(head, T0 + 5)
    assert head.phase == H.Phase.DELAY and "restarting (attempt 2 of 2)" in head.doc["message"]
    assert head.state == RunState.RUNNING
    _, actions = H.decide(head, [], T0 + 9)
    assert "start" not in kinds(actions)
    _, actions = H.decide(head, [], T0 + 10.6)
    assert ("start", 2, "10.1.0.1") in starts(actions) and head.doc["attempt"] == 2
    assert all(r["state"] == "pending" and r["attempt"] == 2 for r in head.doc["ranks"])
    # a late report of attempt 1 changes nothing
    H.decide(head, [rep(head, "b", {3: ("failed", 1, None, T0 + 4)}, attempt=1)], T0 + 11)
    assert head.doc["ranks"][3]["state"] == "pending"
    H.decide(head, [rep(head, "b", {3: ("failed", 1, None, T0 + 12)})], T0 + 12)
    finish_stopping(head, T0 + 13)
    assert head.state == RunState.FAILED and [a["state"] for a in head.doc["attempts"]] == ["failed", "failed"]


def test_a_restarted_attempt_knows_no_launcher_of_the_attempt_before():
    """A launcher (mpirun) that failed in attempt 1 is not attempt 2's: attempt 2 starts with no
    launcher known on any host, so no launcher verdict of attempt 1 decides attempt 2."""
    head = running(restarts=1, restart_delay=5)
    mpirun = {"key": "mpirun.a", "rank": None, "pid": 9, "exit_code": 1, "signal": None, "start": T0, "end": T0 + 4}
    H.decide(head, [rep(head, "a", {0: ("failed", 1, None, T0 + 4)}, procs=[mpirun])], T0 + 4)
    assert H._launchers(head) == {"mpirun.a": ("a", mpirun)}
    finish_stopping(head, T0 + 5, procs={"a": [mpirun]})   # a's last report of attempt 1 still lists it
    assert H._launchers(head) == {"mpirun.a": ("a", mpirun)}
    H.decide(head, [], T0 + 10.6)
    assert head.doc["attempt"] == 2 and H._launchers(head) == {}


def test_a_stop_during_the_restart_delay_ends_stopped():
    head = running(restarts=3, restart_delay=60)
    H.decide(head, [rep(head, "b", {3: ("failed", 1, None, T0 + 4)})], T0 + 4)
    finish_stopping(head, T0 + 5)
    H.decide(head, [H.stop_asked("orch down")], T0 + 6)
    assert head.state == RunState.STOPPED and "orch down" in head.doc["message"]


def test_lost_and_timeout_are_not_restarted():
    head = running(restarts=5)
    H.decide(head, [H.gone("b")], T0 + 2)
    H.decide(head, [], T0 + 2.1)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 2.2), 1: ("stopped", None, 15, T0 + 2.2)},
                        live=False)], T0 + 2.5)
    assert head.state == RunState.LOST and head.doc["attempt"] == 1


def test_a_host_reports_only_its_own_ranks_and_never_undoes_an_end():
    head = running()
    forged = rep(head, "a", {0: ("exited", 0, None, T0 + 2), 1: ("exited", 0, None, T0 + 2)})
    forged[2]["ranks"][0]["host"] = "b"
    forged = H.reported("b", dict(forged[2], host="b"))   # b claiming a's ranks
    H.decide(head, [forged], T0 + 2)
    assert head.doc["ranks"][0]["state"] == "running"
    H.decide(head, [rep(head, "b", {2: ("exited", 0, None, T0 + 3)})], T0 + 3)
    H.decide(head, [rep(head, "b", {2: ("running", None, None, None)})], T0 + 3.5)
    assert head.doc["ranks"][2]["state"] == "exited"


# --------------------------------------------------------------------------- the transition table

EVENT = st.one_of(
    st.tuples(st.just("report"), st.sampled_from(["a", "b"]),
              st.dictionaries(st.integers(0, 3), st.sampled_from(["running", "exited", "failed", "stopped", "pending"]),
                              max_size=4), st.booleans(), st.integers(0, 3),
              st.sampled_from([None, "running", "exited", "failed"])),   # the host's launcher (mpirun), if any
    st.tuples(st.just("gone"), st.sampled_from(["b"])),
    st.tuples(st.just("stop"), st.just("orch down")),
    st.tuples(st.just("tick"), st.floats(0.05, 20)),
)


def _observe(head, seen):
    seen["run"].add(head.doc["state"])
    for a in head.doc["attempts"]:
        seen.setdefault(("attempt", a["attempt"]), []).append(a["state"])
    for r in head.doc["ranks"]:
        seen.setdefault(("rank", r["rank"], r["attempt"]), []).append(r["state"])


def _pairs(history):
    return {(x, y) for x, y in zip(history, history[1:]) if x != y}


@settings(max_examples=300, deadline=None)
@given(cfg=st.fixed_dictionaries({"on_failure": st.sampled_from(["stop", "continue"]), "restarts": st.integers(0, 2),
                                  "stall_timeout": st.sampled_from([None, 15.0]),
                                  "timeout": st.sampled_from([None, 40.0])}),
       events=st.lists(EVENT, max_size=40))
def test_no_sequence_of_events_makes_a_transition_outside_the_table(cfg, events):
    head = make(**cfg)
    t = T0
    history = {"run": [head.doc["state"]]}
    ranks = {}
    attempts = {}
    for ev in [("join",)] + events:
        t += 0.5
        if ev[0] == "join":
            batch = [H.joined("b", "10.0.0.1")]
        elif ev[0] == "report":
            _, host, states, live, dt, launcher = ev
            states = {r: (s, 0 if s == "exited" else (1 if s == "failed" else None),
                          15 if s == "stopped" else None, t - dt if s not in ("running", "pending") else None)
                      for r, s in states.items() if r // 2 == "ab".index(host)}
            procs = [] if launcher is None else [{"key": "mpirun.%s" % host, "rank": None, "pid": 9,
                                                  "exit_code": {"exited": 0, "failed": 1}.get(launcher),
                                                  "signal": None, "start": T0, "end": None if launcher == "running"
                                                  else t - dt}]
            batch = [rep(head, host, states, live=live, out=t, procs=procs)] if head.doc["attempt"] else []
        elif ev[0] == "gone":
            batch = [H.gone(ev[1])]
        elif ev[0] == "stop":
            batch = [H.stop_asked(ev[1])]
        else:
            t += ev[1]
            batch = []
        H.decide(head, batch, t)
        _indexes_agree_with_the_records(head, t)
        history["run"].append(head.doc["state"])
        for a in head.doc["attempts"]:
            attempts.setdefault(a["attempt"], []).append(a["state"])
        for r in head.doc["ranks"]:
            ranks.setdefault((r["rank"], r["attempt"]), []).append(r["state"])
    for x, y in _pairs(history["run"]):
        assert y in RUN_TRANSITIONS.get(RunState(x), ()), (x, y)
    for hist in attempts.values():
        for x, y in _pairs(hist):
            assert y in ATTEMPT_TRANSITIONS.get(RunState(x), ()), (x, y)
    for hist in ranks.values():
        for x, y in _pairs(hist):
            assert y in RANK_TRANSITIONS.get(RankState(x), ()), (x, y)


def _indexes_agree_with_the_records(head, now) -> None:
    """The head's indexes (Head.rank_rec, Head.failed, HostView.launchers) give what a reading of
    every record gives."""
    assert all(head.rank_rec[r["rank"]] is r for r in head.doc["ranks"])
    every = sorted(((r.get("end") or now), r["rank"]) for r in head.doc["ranks"] if r["state"] == RankState.FAILED)
    assert [(t, r["rank"]) for t, r, _ in H._failures(head, now)] == every
    launchers = {p["key"]: (n, p) for n, h in head.hosts.items() if h.report is not None
                 and h.report.get("attempt") == head.doc["attempt"] for p in h.report["procs"] if p.get("rank") is None}
    assert H._launchers(head) == launchers


def _run_transitions_of(scenario) -> set:
    head = make(**scenario.get("cfg", {}))
    before = head.doc["state"]
    seen = set()
    t = T0
    for step in scenario["steps"]:
        t += 0.6
        H.decide(head, step(head), t)
        if head.doc["state"] != before:
            seen.add((before, head.doc["state"]))
            before = head.doc["state"]
    for _ in range(40):   # let stops finish
        t += 1
        evs = [rep(head, h, {r["rank"]: (r["state"] if r["end"] else "stopped", r["exit_code"], r["signal"] or 15,
                                         r["end"] or t) for r in head.doc["ranks"] if r["host"] == h}, live=False,
                   out=t) for h in ("a", "b") if head.doc["attempt"] and h not in head.doc["lost"]]
        H.decide(head, evs, t)
        if head.doc["state"] != before:
            seen.add((before, head.doc["state"]))
            before = head.doc["state"]
    return seen


def test_every_run_transition_in_the_table_happens_in_some_scenario():
    def join(head):
        return [H.joined("b", "10.0.0.1")]

    def nothing(head):
        return []

    def ranks_end(state, code, sig):
        return lambda head: [rep(head, h, {r: (state, code, sig, T0 + 1) for r in range(4)}, live=False)
                             for h in ("a", "b")]

    def ask_stop(head):
        return [H.stop_asked("x")]

    scenarios = [
        {"steps": [join, nothing, ranks_end("exited", 0, None)]},
        {"steps": [join, nothing, ranks_end("failed", 1, None)]},
        {"steps": [join, nothing, ask_stop]},
        {"steps": [join, nothing, lambda head: [H.gone("b")]]},
        {"cfg": {"stall_timeout": 1.0}, "steps": [join] + [nothing] * 5},
        {"cfg": {"timeout": 1.0}, "steps": [join] + [nothing] * 4},
        {"steps": [ask_stop]},
        {"cfg": {"join_timeout": 1}, "steps": [nothing] * 3},
    ]
    seen = set()
    for s in scenarios:
        seen |= _run_transitions_of(s)
    table = {(x, y) for x, ys in RUN_TRANSITIONS.items() for y in ys}
    # starting -> failed is a crash of the head (server.Supervisor.crashed), not a decision
    assert seen == table - {(RunState.STARTING, RunState.FAILED)}, sorted(table - seen)


def test_decide_is_pure_the_same_events_give_the_same_result():
    a, b = running(), running()
    evs = [rep(a, "b", {2: ("failed", 1, None, T0 + 4)})]
    ra = H.decide(a, copy.deepcopy(evs), T0 + 4)[1]
    rb = H.decide(b, copy.deepcopy(evs), T0 + 4)[1]
    assert ra == rb and a.doc == b.doc


@pytest.mark.parametrize("bad", [{"rank": 0, "state": "exploded"}])
def test_a_report_with_an_unknown_state_never_reaches_decide(bad):
    from orchestrator.agent import protocol
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_report({"host": "a", "attempt": 1, "ranks": [bad], "procs": [], "out": 0, "live": True})


def test_a_host_lost_while_a_failed_attempt_stops_is_not_restarted():
    head = running(restarts=3)
    H.decide(head, [rep(head, "b", {3: ("failed", 1, None, T0 + 4)})], T0 + 4)
    H.decide(head, [H.gone("b")], T0 + 4.2)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 4.3), 1: ("stopped", None, 15, T0 + 4.3)},
                        live=False)], T0 + 4.5)
    assert head.phase == H.Phase.DONE and head.state == RunState.FAILED
    assert "not restarted: lost contact with host b" in head.doc["message"]


def test_a_report_of_an_ended_rank_without_an_end_is_refused():
    from orchestrator.agent import protocol

    base = {"rank": 0, "pid": 1, "exit_code": 0, "signal": None, "start": 1.0, "attempt": 1}
    with pytest.raises(protocol.ProtocolError):
        protocol._parse_rank({**base, "state": "exited", "end": None})
    with pytest.raises(protocol.ProtocolError):
        protocol._parse_rank({**base, "state": "running", "end": 5.0})
    assert protocol._parse_rank({**base, "state": "exited", "end": 5.0})["state"] == "exited"


# --------------------------------------------------------------------------- spares

def _server(name, addr, ranks=()):
    return {"name": name, "address": addr, "slots": 2, "ranks": [list(r) for r in ranks], "device_ips": {},
            "super_device_ids": {}, "super_pod_id": None}


def with_spares(spares=("s1",), fits=None, **cfg):
    """A running head over hosts a, b (ranks 0-3, mpirun's hostfile) with spares that may replace b."""
    fits = fits if fits is not None else {s: ["b"] for s in spares}
    servers = [_server("a", "10.0.0.1", [(0, 0), (1, 1)]), _server("b", "10.0.0.2", [(2, 0), (3, 1)])]
    head = make(spares=list(spares), spare_fits=fits, tables={"hostfile": "hostfile"}, servers=servers,
                spare_servers=[_server(s, "10.0.0.%d" % (9 + i)) for i, s in enumerate(spares)], **cfg)
    _, actions = H.decide(head, [H.joined(h, "10.0.0.1") for h in ("b", *spares)], T0 + 1)
    assert starts(actions) == [("start", 1, "10.0.0.1")]
    H.decide(head, [rep(head, h, {}) for h in ("a", "b")], T0 + 1.5)
    return head


def lose_b(head, t):
    """b's supervisor connection closes; a's ranks stop; returns the actions of the stop's end."""
    H.decide(head, [H.gone("b")], t)
    H.decide(head, [], t + 0.1)
    _, actions = H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, t + 0.2), 1: ("stopped", None, 15, t + 0.2)},
                                     live=False)], t + 0.5)
    return actions


def test_a_lost_host_is_replaced_by_a_spare_which_runs_its_ranks_with_files_rendered_for_the_new_host_set():
    head = with_spares()
    lose_b(head, T0 + 3)
    assert head.phase == H.Phase.DELAY and head.state == RunState.RUNNING     # restarts: 0, yet replaced
    assert "spare s1 takes the place of host b: attempt 2 starts on the new host set" in head.doc["message"]
    assert head.doc["replaced"] == [] and head.doc["hosts"] == ["a", "b"]   # recorded when attempt 2 starts
    _, actions = H.decide(head, [], T0 + 4)
    (start,) = [a for a in actions if a[0] == "start"]
    _, k, _, setup = start
    assert k == 2 and setup["slots"] == {"s1": "b"} and setup["replaced"] == "b->s1"
    assert protocol.unpack_files(setup["files"]) == {"hostfile": "# orch: 2 hosts, 4 ranks, in plan order (ranks are contiguous per host, "
                                          "by slot)\n10.0.0.1 slots=2\n10.0.0.9 slots=2\n"}
    assert [r["host"] for r in head.doc["ranks"]] == ["a", "a", "s1", "s1"]
    assert head.doc["hosts"] == ["a", "s1"] and head.doc["spares"] == [] and head.doc["lost"] == []
    assert head.doc["attempts"][0]["hosts"] == ["a", "b"] and head.doc["attempts"][1]["hosts"] == ["a", "s1"]
    assert head.doc["replaced"][0]["host"] == "b" and head.doc["replaced"][0]["by"] == "s1"
    assert "connection to its supervisor closed" in head.doc["replaced"][0]["why"]
    # the spare's reports now count for ranks 2-3; the old host's are ignored
    H.decide(head, [rep(head, "a", {0: ("exited", 0, None, T0 + 5), 1: ("exited", 0, None, T0 + 5)}),
                    rep(head, "s1", {2: ("exited", 0, None, T0 + 5), 3: ("exited", 0, None, T0 + 5)})], T0 + 5)
    finish_stopping(head, T0 + 5.5, hosts=("a", "s1"))
    assert head.state == RunState.SUCCEEDED and head.doc["message"] == "all 4 ranks exited 0"


def test_with_no_spare_left_the_run_ends_lost_naming_the_host_and_where_the_spares_went():
    head = with_spares(spares=("s1", "s2"), lost_after=100)
    H.decide(head, [H.gone("s2")], T0 + 2)          # an idle spare is lost: the run goes on
    assert head.phase == H.Phase.RUN and head.doc["spares"] == ["s1"]
    lose_b(head, T0 + 3)
    H.decide(head, [], T0 + 4)
    H.decide(head, [rep(head, "a", {}), rep(head, "s1", {})], T0 + 4.5)
    assert head.doc["attempt"] == 2
    H.decide(head, [H.gone("s1")], T0 + 6)            # now the spare that took b's place is lost too
    H.decide(head, [], T0 + 6.1)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 6.2), 1: ("stopped", None, 15, T0 + 6.2)},
                        live=False)], T0 + 6.5)
    assert head.state == RunState.LOST and head.phase == H.Phase.DONE
    msg = head.doc["message"]
    assert "lost contact with host s1" in msg and "no spare host left to take the place of s1" in msg
    assert "s1 took b's place in attempt 2" in msg and "s2 was lost" in msg


def test_a_spare_replaces_only_a_host_it_fits_and_never_the_launch_host():
    head = with_spares(fits={"s1": []})
    lose_b(head, T0 + 3)
    assert head.state == RunState.LOST and "no spare host left to take the place of b" in head.doc["message"]
    assert "s1 is free but fits none of them" in head.doc["message"]


def test_a_failure_not_naming_a_host_restarts_on_the_same_hosts_with_the_restarts_budget():
    head = with_spares(restarts=1)
    H.decide(head, [rep(head, "b", {2: ("failed", 1, None, T0 + 2)})], T0 + 2)
    finish_stopping(head, T0 + 2.2)
    assert head.phase == H.Phase.DELAY and head.doc["replaced"] == [] and head.doc["hosts"] == ["a", "b"]
    _, actions = H.decide(head, [], T0 + 3)
    assert [a[3]["slots"] for a in actions if a[0] == "start"] == [{}]


def test_a_stop_during_the_delay_records_no_replacement_that_never_ran():
    head = with_spares(restart_delay=30)
    lose_b(head, T0 + 3)
    H.decide(head, [H.stop_asked("`orch down`")], T0 + 5)
    assert head.state == RunState.STOPPED and head.doc["replaced"] == [] and head.doc["lost"] == ["b"]
    assert [r["host"] for r in head.doc["ranks"]] == ["a", "a", "b", "b"]


def test_a_spare_lost_during_the_delay_is_not_started_another_is_chosen_or_the_run_ends():
    head = with_spares(spares=("s1", "s2"), restart_delay=1)
    lose_b(head, T0 + 3)
    H.decide(head, [H.gone("s1")], T0 + 3.6)
    _, actions = H.decide(head, [], T0 + 4.6)
    assert [a[3]["slots"] for a in actions if a[0] == "start"] == [{"s2": "b"}]
    head = with_spares(restart_delay=1)
    lose_b(head, T0 + 3)
    _, actions = H.decide(head, [H.gone("s1")], T0 + 3.6)
    _, actions = H.decide(head, [], T0 + 4.6)
    assert "start" not in kinds(actions) and head.state == RunState.LOST
    assert "no spare host left to take the place of b" in head.doc["message"] and "s1 was lost" in head.doc["message"]


def test_one_free_spare_for_two_lost_hosts_says_so():
    head = make(("a", "b", "c"), spares=["s1"], spare_fits={"s1": ["b", "c"]}, tables={},
                servers=[], spare_servers=[])
    H.decide(head, [H.joined(h, "10.0.0.1") for h in ("b", "c", "s1")], T0 + 1)
    H.decide(head, [rep(head, h, {}) for h in ("a", "b", "c")], T0 + 1.5)
    H.decide(head, [H.gone("b"), H.gone("c")], T0 + 2)
    H.decide(head, [], T0 + 2.1)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 2.2), 1: ("stopped", None, 15, T0 + 2.2)},
                        live=False)], T0 + 2.5)
    assert head.state == RunState.LOST
    assert "2 hosts lost, 1 spare(s) free: s1 is free and fits b, c" in head.doc["message"]


def test_a_silent_hosts_spare_waits_until_its_ranks_have_been_stopped_there():
    head = with_spares(lost_after=10)
    H.decide(head, [rep(head, "a", {}), rep(head, "s1", {}, attempt=0)], T0 + 11)
    H.decide(head, [rep(head, "a", {}), rep(head, "s1", {}, attempt=0)], T0 + 11.6)   # b: silent
    H.decide(head, [], T0 + 11.7)
    H.decide(head, [rep(head, "a", {0: ("stopped", None, 15, T0 + 12), 1: ("stopped", None, 15, T0 + 12)},
                        live=False), rep(head, "s1", {}, attempt=0)], T0 + 12)
    assert head.phase == H.Phase.DELAY and head.phase_until >= T0 + 12 + head.grace + H.LOST_RANKS_STOP
