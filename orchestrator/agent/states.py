"""Run, attempt and rank states: the enums, the terminal set, the transition table, and the
words orch uses for how a process ended. The controller (runstate.py, status, logs) and the
supervisor on the hosts both use these: one copy of each rule.

    run      starting -> running | stopped | lost | failed
             running  -> succeeded | failed | stopped | lost | stalled | timeout
             (interrupted: an attached `orch up` stopped by Ctrl-C; the controller's record only)
    attempt  running  -> succeeded | failed | stopped | lost | stalled | timeout
    rank     pending  -> running | exited | failed | stopped | lost
             running  -> exited | failed | stopped | lost
             failed   -> stopped   (killed by the launcher's TERM/KILL after another rank failed)

Values are plain strings on the wire and in every document (the enums are `str`s).
`unknown` (a host that cannot be read) and `orphaned` (a rank alive after its run ended) are
views the controller shows; no supervisor records them.
"""

from __future__ import annotations

import signal
from enum import Enum

from .layout import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import AbstractSet, Iterable, Mapping, TypeVar


class RunState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    STALLED = "stalled"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


class RankState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    EXITED = "exited"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    UNKNOWN = "unknown"
    ORPHANED = "orphaned"

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self in (RankState.EXITED, RankState.FAILED, RankState.STOPPED, RankState.LOST)


TERMINAL = frozenset({RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED, RunState.LOST,
                      RunState.STALLED, RunState.TIMEOUT, RunState.INTERRUPTED})
RETRYABLE = frozenset({RunState.FAILED, RunState.STALLED})   # an attempt ending so may be restarted

_ENDS = (RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED, RunState.LOST, RunState.STALLED,
         RunState.TIMEOUT)
RUN_TRANSITIONS = {
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPED, RunState.LOST, RunState.FAILED}),
    RunState.RUNNING: frozenset(_ENDS),
}
ATTEMPT_TRANSITIONS = {RunState.RUNNING: frozenset(_ENDS)}
RANK_TRANSITIONS = {
    RankState.PENDING: frozenset({RankState.RUNNING, RankState.EXITED, RankState.FAILED, RankState.STOPPED,
                                  RankState.LOST}),
    RankState.RUNNING: frozenset({RankState.EXITED, RankState.FAILED, RankState.STOPPED, RankState.LOST}),
    RankState.FAILED: frozenset({RankState.STOPPED}),
}


class IllegalTransition(ValueError):
    pass


if TYPE_CHECKING:
    _S = TypeVar("_S", RunState, RankState)


def allowed(table: Mapping[_S, AbstractSet[_S]], old: _S, new: _S) -> bool:
    return new == old or new in table.get(old, ())


def check(table: Mapping[_S, AbstractSet[_S]], old: _S, new: _S, what: str = "state") -> _S:
    """`new` if the table allows old -> new (or they are equal); else IllegalTransition."""
    if not allowed(table, old, new):
        raise IllegalTransition("%s: %s -> %s is not a transition" % (what, old, new))
    return new


def run_state(value: object, default: RunState = RunState.UNKNOWN) -> RunState:
    """A run state from a document's string; `default` for anything else."""
    try:
        return RunState(value)
    except ValueError:
        return default


def rank_state(value: object, default: RankState = RankState.UNKNOWN) -> RankState:
    try:
        return RankState(value)
    except ValueError:
        return default


def describe(code: int | None, sig: int | None = None) -> str:
    """How a process ended, in words: `exit code 3`, `killed by signal 9 (SIGKILL)`. A shell's
    128+N is an exit code, not a signal: only `sig` says a signal killed it."""
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "signal %d" % sig
        return "killed by signal %d (%s)" % (sig, name)
    if code is None:
        return "no exit code (killed or lost)"
    return "exit code %d" % code


def rank_ranges(ranks: Iterable[int]) -> str:
    """`rank 3`, `ranks 0-3,8`: rank numbers folded (the hosts have no ClusterShell; the
    controller folds with RangeSet, and a unit test holds the two to the same text)."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    if len(ordered) == 1:
        return "rank %d" % ordered[0]
    parts, start, prev = [], ordered[0], ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else "%d-%d" % (start, prev))
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)
