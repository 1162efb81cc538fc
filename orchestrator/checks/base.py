"""What every check is made of, what they give, and the registry of them.

A check (`Check`) says when it has a result for a host (`applies`), the shell it needs in the
host's probe (`probes`: `Probe`s, each giving (section name, commands) pairs; several checks may
share one), how it judges one host from its sections (`judge`), and, if it compares hosts or
needs none, how it judges across them (`across`) or here (`local`). Each check module of this
package registers its Check with `register`; `registered()` gives them in the report's order
(names.KNOWN_CHECKS).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Mapping, Sequence

from .. import probes
from ..devices import HccnDevice
from ..errors import OrchError
from ..probes import Section
from ..hostsets import by_value, fold
from ..model import Host
from .names import KNOWN_CHECKS

if TYPE_CHECKING:
    from .checkplan import CheckPlan

Status = Literal["pass", "warn", "fail", "error"]
SEVERITY = {"pass": 0, "warn": 1, "error": 2, "fail": 3}


@dataclass(frozen=True)
class CheckResult:
    check: str
    host: str | None  # None: cluster-wide (a version mismatch...)
    status: Status
    message: str
    hosts: tuple[str, ...] = field(default=(), compare=False)  # cluster-wide: the hosts it is about

    def to_dict(self) -> dict:
        return {"check": self.check, "host": self.host, "status": self.status, "message": self.message}


@dataclass(frozen=True)
class Problem:
    """One non-pass message, shown once for every host that gave it."""

    status: Status
    check: str
    hosts: str | None  # folded host set, None for a cluster-wide result
    message: str


@dataclass
class Report:
    results: list[CheckResult]
    hosts: tuple[str, ...] = ()  # host names in plan order
    duration: float = 0.0
    # what the probes read that `orch up` needs again: {host: its /etc/hccn.conf} (present ones)
    hccn: dict[str, dict[int, HccnDevice]] = field(default_factory=dict, compare=False)
    # ... and, when asked for (run_checks(prepare=True)), {host: its prepare facts} (prepare.py)
    prepared: dict[str, dict] = field(default_factory=dict, compare=False)
    # ... and {host: what it has of what sync writes} (sync.parse_listing), for sync
    listed: dict[str, dict] = field(default_factory=dict, compare=False)

    @property
    def ok(self) -> bool:
        return not any(r.status in ("fail", "error") for r in self.results)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "results": [r.to_dict() for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def checks(self) -> list[str]:
        """Checks that produced a result, in KNOWN_CHECKS order."""
        seen = {r.check for r in self.results}
        return [c for c in KNOWN_CHECKS if c in seen]

    def cells(self) -> dict[str, dict[str, Status]]:
        """{host: {check: worst status}} from per-host results and cluster-wide results naming the host."""
        out: dict[str, dict[str, Status]] = {h: {} for h in self.hosts}
        for r in self.results:
            for h in ([r.host] if r.host is not None else r.hosts):
                row = out.setdefault(h, {})
                cur = row.get(r.check)
                if cur is None or SEVERITY[r.status] > SEVERITY[cur]:
                    row[r.check] = r.status
        return out

    def problems(self) -> list[Problem]:
        """Each non-pass message once, with the folded set of hosts that gave it; worst first."""
        groups: dict[tuple, list[str]] = {}
        order: list[tuple] = []
        for r in self.results:
            if r.status == "pass":
                continue
            key = (r.status, r.check, r.host is None, r.message)
            if key not in groups:
                groups[key] = []
                order.append(key)
            if r.host is not None:
                groups[key].append(r.host)
        rank = {c: i for i, c in enumerate(KNOWN_CHECKS)}
        merged: dict[tuple, list[str]] = {}  # the same message for the same hosts from several checks: once
        for k in order:
            hosts = None if k[2] else fold(groups[k])
            merged.setdefault((k[0], hosts, k[3]), []).append(k[1])
        out = [Problem(st, ",".join(checks), hosts, msg) for (st, hosts, msg), checks in merged.items()]
        out.sort(key=lambda p: (-SEVERITY[p.status], rank.get(p.check.split(",")[0], 99)))
        return out


@dataclass(frozen=True)
class ProbeRun:
    """What came back from one host: the parsed sections, or why there are none."""

    host: Host
    sections: Mapping[str, Section] | None
    error: OrchError | None = None
    stage: Literal["connect", "probe"] | None = None
    t_send: float = 0.0  # wall clock (time.time()) when the probe was sent ...
    t_recv: float = 0.0  # ... and when its output was back
    connect_time: float = 0.0
    addresses: frozenset[str] | None = None  # the inventory address as IPs (None: DNS name not resolvable here)
    # `orch up`: what the host listed of the sync (runner.listed: its synclist or reach section,
    # read once for the files check and Report.listed); None: no listing, or not a whole one
    listed: dict | None = None


# --------------------------------------------------------------------------- a check


@dataclass(frozen=True)
class Probe:
    """Shell for the probe: `shell(plan, host)` -> [(section name, commands)] ([] when this host
    needs none). Checks that need the same sections share one Probe (it runs once).

    place: "body" in the checks' order; "frame" around everything (first the first section,
    last the others: when the probe starts and ends); "background" started first and printed
    last (it overlaps the others); "lead" run before the body, in the probe's own shell, where
    its program may print other sections and hold the session (probes.assemble)."""

    key: str
    shell: Callable[[CheckPlan, Host], list[tuple[str, str]]]
    place: Literal["body", "frame", "background", "lead"] = "body"


def _always(plan: CheckPlan, host: Host) -> bool:
    return True


@dataclass(frozen=True)
class Check:
    """One check of `orch check`.

    applies(plan, host): does the host get a per-host result (it is asked only for checks the
    plan runs); probes: the shell it needs on a host; judge(plan, run) -> the host's results,
    from its sections (`section(run, name)` raises when one is missing: the check's result is
    then `error`); across(plan, runs) -> cluster-wide results from the hosts that answered;
    local(plan) -> results that need no host. probe_after: its sections go into the probe right
    after this check's (the probe's order is otherwise the report's)."""

    name: str
    applies: Callable[[CheckPlan, Host], bool] = _always
    probes: tuple[Probe, ...] = ()
    judge: Callable[[CheckPlan, ProbeRun], list[CheckResult]] | None = None
    across: Callable[[CheckPlan, Sequence[ProbeRun]], list[CheckResult]] | None = None
    local: Callable[[CheckPlan], list[CheckResult]] | None = None
    probe_after: str | None = None


REGISTRY: dict[str, Check] = {}
_INFRASTRUCTURE = {"base", "names", "checkplan", "runner"}  # the modules of this package that hold no check


def register(check: Check) -> Check:
    """Add a check to the registry (each check module does, once, for each of its checks)."""
    if check.name not in KNOWN_CHECKS:
        raise ValueError(f"check {check.name!r} is not in names.KNOWN_CHECKS (its place in the report)")
    if check.name in REGISTRY:
        raise ValueError(f"check {check.name!r} is registered twice")
    REGISTRY[check.name] = check
    return check


def registered() -> list[Check]:
    """Every check, in the report's order (imports this package's check modules the first time)."""
    if len(REGISTRY) < len(KNOWN_CHECKS):
        for m in pkgutil.iter_modules([os.path.dirname(__file__)]):
            if m.name not in _INFRASTRUCTURE:
                importlib.import_module(f"{__package__}.{m.name}")
        missing = [n for n in KNOWN_CHECKS if n not in REGISTRY]
        if missing:
            raise RuntimeError(f"no module of {__package__} registers the check(s) {', '.join(missing)}")
    return [REGISTRY[n] for n in KNOWN_CHECKS]


def check(name: str) -> Check:
    registered()
    return REGISTRY[name]


# --------------------------------------------------------------------------- judging helpers


class Missing(Exception):
    """A section the judge needs is not there (or was cut off): the check's result is `error`."""


def section(sections: Mapping[str, Section] | None, name: str) -> Section:
    s = None if sections is None else sections.get(name)
    if s is None:
        raise Missing(f"the probe printed no '{name}' section (it stopped early, or its output was cut)")
    if not s.finished:
        raise Missing(f"the probe was cut off during '{name}': {probes.quote_output(s.body)}")
    return s


def result(check: str, host: Host | str | None, status: Status, message: str,
           hosts: Iterable[str] = ()) -> CheckResult:
    name = host.name if isinstance(host, Host) else host
    return CheckResult(check, name, status, message, tuple(hosts))


def ids(ids) -> str:
    """Device ids, folded (0-3,5), or 'none'."""
    ids = sorted(ids)
    return fold(str(i) for i in ids) if ids else "none"


def split_by(per_host: Mapping[str, str], label: Callable[[str], str] = str) -> tuple[dict[str, list[str]], str]:
    """{host: value} -> ({value: [hosts]}, 'value on hosts; ...' biggest group first)."""
    groups: dict[str, list[str]] = {}
    for h, v in per_host.items():
        groups.setdefault(v, []).append(h)
    parts = "; ".join(f"{label(v)} on {hs}" for v, hs in by_value(per_host.items(), most_first=True))
    return groups, parts
