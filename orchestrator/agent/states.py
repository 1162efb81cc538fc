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

from .layout import TYPE_CHECKING, signal

if TYPE_CHECKING:
    from enum import Enum as _Words
    from typing import AbstractSet, Iterable, Mapping, TypeVar
else:
    class _WordsType(type):
        """What the states need of enum.Enum, for `str` members, without importing enum (~3.3 ms of
        CPU, with functools and collections, on every start of a supervisor and every agent call on
        every host; socket, signal, selectors and re import it too, and the agent uses none of them):
        each upper-case class attribute becomes a member (an instance, equal to its string and hashing
        as it does); Class(value) is that member (ValueError for anything else); iterating the class
        gives the members in their order. Type checkers see enum.Enum (the TYPE_CHECKING branch): the
        same names and the same use; tests/unit/test_agent_stdlib.py holds the two to the same behaviour."""

        def __new__(mcs, name, bases, ns):
            cls = super().__new__(mcs, name, bases, ns)
            members = {}
            for key, value in ns.items():
                if key.isupper() and isinstance(value, str):
                    member = str.__new__(cls, value)
                    member._name_ = key
                    members[value] = member
                    setattr(cls, key, member)
            cls._members_ = members
            if "__repr__" not in ns:   # enum's: <RunState.RUNNING: 'running'> (str's would come first)
                cls.__repr__ = _Words.__repr__
            return cls

        def __call__(cls, value):
            if isinstance(value, str):
                found = cls._members_.get(value)
                if found is not None:
                    return found
            raise ValueError("%r is not a valid %s" % (value, cls.__name__))

        def __iter__(cls):
            return iter(list(cls._members_.values()))

        def __len__(cls):
            return len(cls._members_)

    class _Words(metaclass=_WordsType):
        __slots__ = ()

        @property
        def value(self):
            return str.__str__(self)

        @property
        def name(self):
            return self._name_

        def __repr__(self):
            return "<%s.%s: %r>" % (type(self).__name__, self._name_, str.__str__(self))

        def __reduce__(self):
            return type(self), (str.__str__(self),)


class RunState(str, _Words):
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


class RankState(str, _Words):
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


_SIGNAL_NAMES: dict[int, str] = {}


def signal_name(sig: int) -> str | None:
    """SIGKILL for 9: signal.Signals(sig).name without enum (an alias's value gets the first name
    in alphabetical order, as Signals gives it: SIGABRT, not SIGIOT); None for a number no name has."""
    if not _SIGNAL_NAMES:
        for name in sorted(dir(signal), reverse=True):
            value = getattr(signal, name)
            if name.isupper() and name.startswith("SIG") and not name.startswith("SIG_") and isinstance(value, int):
                _SIGNAL_NAMES[value] = name
    return _SIGNAL_NAMES.get(sig)


def describe(code: int | None, sig: int | None = None) -> str:
    """How a process ended, in words: `exit code 3`, `killed by signal 9 (SIGKILL)`. A shell's
    128+N is an exit code, not a signal: only `sig` says a signal killed it."""
    if sig:
        name = signal_name(sig) or "signal %d" % sig
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
