"""Host sets: NodeSet/RangeSet expansion and folding (ClusterShell), one place for both.

`node[01-16]` -> names, names -> `node[01-16]`, and "these hosts have this value" -> one
folded line per value. Nothing here consults ClusterShell's group sources.
"""

from __future__ import annotations

import re
from typing import Hashable, Iterable, TypeVar

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet
from ClusterShell.NodeSet import NodeSetParseError as NodeSetParseError  # model.py catches it from here

# NodeSet must never consult ClusterShell's group sources (/etc/clustershell/groups*): orch
# resolves its own groups, and `*` or `@x` in an inventory must not expand to this machine's groups.
_NO_GROUPS = RESOLVER_NOGROUP
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9._:-]+$")


def fold(names: Iterable[object]) -> str:
    """node01,node02,node03 -> node[01-03] (ClusterShell's folding). Names that are not plain
    host names (spaces, quotes, NodeSet operators...) are listed as they are, never parsed."""
    strs = [str(n) for n in names]
    if not all(_PLAIN_NAME.match(n) for n in strs):
        return ",".join(strs)
    try:
        return str(NodeSet.fromlist(strs, resolver=_NO_GROUPS))
    except NodeSetParseError:
        return ",".join(strs)


MAX_EXPANSION = 100_000  # hosts one pattern may expand to (more is a typo, and would take forever)
_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def range_size(pattern: str) -> int | None:
    """How many names a NodeSet pattern gives, counted without expanding it (NodeSet itself
    builds every member, so `n[1-99999999]` would take minutes). None: not countable here
    (NodeSet will report what is wrong with it)."""
    total = 0
    for part in re.split(r",(?![^\[]*\])", pattern):  # commas outside brackets
        n = 1
        for group in _BRACKETS.findall(part):
            count = 0
            for item in group.split(","):
                lo, sep, hi = item.partition("-")
                hi, _, step = hi.partition("/")
                if not lo.strip().isascii() or not lo.strip().isdigit():
                    return None
                if not sep:
                    count += 1
                    continue
                if not hi.strip().isascii() or not hi.strip().isdigit():
                    return None
                st = int(step) if step.strip().isascii() and step.strip().isdigit() and int(step) > 0 else 1
                count += max(0, (int(hi) - int(lo)) // st + 1)
            n *= count
        total += n
    return total


def expand(pattern: str) -> list[str]:
    """A NodeSet pattern (`node[01-16]`, `10.0.0.[1-4],10.0.1.1`) -> names, at most MAX_EXPANSION.
    Raises NodeSetParseError for a bad pattern."""
    n = range_size(pattern)
    if n is not None and n > MAX_EXPANSION:
        raise NodeSetParseError(pattern, f"it expands to {n} names; at most {MAX_EXPANSION} are allowed")
    return list(NodeSet(pattern, resolver=_NO_GROUPS))


def expand_names(name: str) -> list[str]:
    """A host `name` from the inventory: a range (`node[1-4]`, any text with `[`) expands like an
    address; anything else is taken literally, whatever characters it holds."""
    if "[" not in name:
        return [name]
    return expand(name)


V = TypeVar("V", bound=Hashable)


def by_value(pairs: Iterable[tuple[str, V]], *, most_first: bool = False) -> list[tuple[V, str]]:
    """(host, value) pairs -> [(value, folded hosts)], one entry per distinct value, in the
    order first seen (`most_first`: the value most hosts share first, ties as first seen):
    what a table or a message shows once, labelled with its hosts (`node[01-16]`), instead of
    once per host."""
    groups: dict[V, list[str]] = {}
    for host, value in pairs:
        groups.setdefault(value, []).append(host)
    ordered = sorted(groups.items(), key=lambda kv: -len(kv[1])) if most_first else list(groups.items())
    return [(value, fold(hosts)) for value, hosts in ordered]
