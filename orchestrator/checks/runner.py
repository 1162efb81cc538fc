"""Running the checks: one probe per host (the sections of every check that runs, as one script
over the host's one connection), every host at once (up to ssh.fanout), and the judges.

    report = run_checks(cluster, pool, rank_plan, full_mesh=False, on_result=print)
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Callable, Iterable, Mapping, Sequence

from .. import probes
from ..errors import HostError, OrchError, PlanError
from ..fanout import fan_out
from ..shards import decode_error, encode_error, fan_out_procs
from ..rankplan import RankPlan
from ..probes import ProbeError
from ..model import Cluster, Host
from .base import REGISTRY, Check, CheckResult, Missing, Probe, ProbeRun, Report, registered, result
from .base import check as registered_check
from .checkplan import CheckPlan, make_check_plan
from .names import KNOWN_CHECKS
from . import reach
from .devices import hccn_confs
from ..prepare import facts, probe_section
from ..sync import LISTING_SECTION, Entry, listing_script, parse_listing

# `orch up`'s prepare facts that no check's section reads: a section of the probe of their own
# (prepare.py owns the facts; not a check: no result, no row in the report; they reach `up`
# through Report.prepared)
PREPARE = Probe("prepare", lambda plan, host: probe_section(plan))
# ... and what the host has of what sync writes (sync.listing_script): sync then needs no listing
# round trip of its own. A host whose reach test lists it (reach.lists_sync) has no section of it.
SYNC_LISTING = Probe("synclist", lambda plan, host: [(LISTING_SECTION, listing_script(plan.cluster.job.workdir,
                                                                                       plan.listing))]
                     if plan.listing and not reach.lists_sync(plan, host) else [])

HEAD_START = 1.0  # seconds the other hosts give the mesh sources to connect first


# --------------------------------------------------------------------------- the probe script


def probe_order(checks: Sequence[Check]) -> list[Check]:
    """The checks in the order their sections go into the probe: the report's, except for a check
    that says whose sections its own follow (probe_after)."""
    out = [c for c in checks if c.probe_after is None]
    for c in checks:
        if c.probe_after is not None:
            out.insert(out.index(REGISTRY[c.probe_after]) + 1, c)
    return out


def sections_for(plan: CheckPlan, host: Host, checks: Iterable[Check]) -> dict[str, list[tuple[str, str]]]:
    """{place: [(section name, commands)]} of these checks' probes on this host, each probe once."""
    out: dict[str, list[tuple[str, str]]] = {"frame": [], "background": [], "lead": [], "body": []}
    seen: set[str] = set()
    for c in checks:
        for p in c.probes:
            if p.key not in seen:
                seen.add(p.key)
                out[p.place] += p.shell(plan, host)
    return out


def probe_script(plan: CheckPlan, host: Host) -> str:
    """The one script run on `host`: the sections of every check the plan runs (the frame's,
    the clock, always; for `orch up`, prepare's last). Pure: same inputs, same script."""
    checks = probe_order(registered())
    frame = sections_for(plan, host, [c for c in checks if any(p.place == "frame" for p in c.probes)])["frame"]
    got = sections_for(plan, host, [c for c in checks if c.name in plan.checks])
    got["body"] += PREPARE.shell(plan, host) + SYNC_LISTING.shell(plan, host)  # `orch up`'s: none otherwise
    return probes.assemble(host.name, frame[:1], got["background"], got["body"], frame[1:],
                           hold=reach.SECTION if reach.holds(plan, host) else "",
                           given=reach.given(plan, host), lead=got["lead"])


def check_script(plan: CheckPlan, host: Host, check: Check) -> str:
    """The shell one check puts into the host's probe: its sections, each between its markers
    (a background section's commands as they are started)."""
    got = sections_for(plan, host, [check])
    return "".join(probes.section_script(n, b) + "\n" for place in ("frame", "background", "lead", "body")
                   for n, b in got[place])


def probe_for(cluster: Cluster, host_name: str, *, full_mesh: bool = False, deep: bool = False) -> str:
    """The probe script `orch check` would run on one host (`orch check --print-probe HOST`)."""
    plan = make_check_plan(cluster, full_mesh=full_mesh, deep=deep)
    return probe_script(plan, cluster.host(host_name))


# --------------------------------------------------------------------------- running


class _Watch:
    """The probe's output as it comes, shown to `on_text` (the whole text so far) until it says
    it has seen what it waited for."""

    def __init__(self, on_text: Callable[[str], bool]):
        self.buf = bytearray()
        self.on_text: Callable[[str], bool] | None = on_text

    def write(self, data) -> int:
        self.buf += data
        if self.on_text is not None and self.on_text(self.buf.decode("utf-8", "replace")):
            self.on_text = None
        return len(data)

    def flush(self) -> None:
        pass


def probe_host(plan: CheckPlan, pool, host: Host, on_started: Callable[[], None] | None = None, *,
               watch: Callable[[str], bool] | None = None,
               plan_for: Callable[[Host], CheckPlan] | None = None) -> ProbeRun:
    """Connect (once) and run the probe. Never raises an OrchError: it becomes part of the ProbeRun.
    `on_started` is called once the probe runs on the host (its first output came back), or once
    it cannot (the connection or the probe failed); `watch` is shown the output as it comes (the
    launch host's: the reach listener); `plan_for`, once connected, gives the plan to make the
    script from (the other hosts': with the reach listener)."""
    transport = pool[host]
    addresses = resolve_address(host.cluster_address)
    hplan = plan   # this host's plan (plan_for's: with the reach listener)
    script = probe_script(plan, host) if plan_for is None else None  # ready before the connection is
    started = _Once(on_started)
    c0 = time.monotonic()
    try:
        try:
            transport.connect()
        except OrchError as exc:
            return ProbeRun(host, None, exc, "connect", connect_time=time.monotonic() - c0, addresses=addresses)
        connect_time = time.monotonic() - c0
        if script is None:
            assert plan_for is not None  # the script is made here only when it waits for plan_for
            hplan = plan_for(host)
            script = probe_script(hplan, host)
        t_send = time.time()
        sink = None
        if watch is not None or on_started is not None:
            def seen(text: str) -> bool:
                started()
                return watch is None or watch(text)

            sink = _Watch(seen)
        hold = reach.holds(hplan, host)
        try:
            res = transport.probe(script, sink=sink, hold=hold)  # a script of any size goes on stdin
        except OrchError as exc:
            return ProbeRun(host, None, exc, "probe", connect_time=connect_time, addresses=addresses)
    finally:
        started()
    t_recv = time.time()
    out = (sink.buf.decode("utf-8", "replace") if sink is not None else "") + res.out
    sections = probes.split_sections(out)
    if hold and not reach.held(sections):   # its reach test did not stay: the start goes its own way
        transport.release_held()
    if not sections:
        tail = (res.err.strip() or out.strip())[-300:]
        return ProbeRun(host, None, HostError(host.name, f"the probe printed nothing usable (exit code "
                                              f"{res.exit_code}){': ' + tail if tail else ''}"),
                        "probe", connect_time=connect_time, addresses=addresses)
    return ProbeRun(host, sections, None, None, t_send, t_recv, connect_time, addresses,
                    listed(hplan, host, sections))


def listed(plan: CheckPlan, host: Host, sections: Mapping[str, probes.Section]) -> dict | None:
    """What a host's probe listed of the sync (sync.parse_listing), when its section ended well:
    the synclist section, or the reach test's where that listed it (reach.lists_sync). `plan`:
    the one the host's probe was made from."""
    s = sections.get(reach.SECTION if reach.lists_sync(plan, host) else LISTING_SECTION)
    return parse_listing(plan.listing, s.body) if plan.listing and s is not None and s.rc == 0 else None


class _Once:
    """Calls `fn` the first time it is called (from any thread), never again; returns None."""

    def __init__(self, fn: Callable[[], None] | None):
        self.fn, self.lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def run_checks(cluster: Cluster, pool, rank_plan: RankPlan | PlanError | None = None, *, full_mesh: bool = False,
               deep: bool = False, on_result: Callable[[CheckResult], None] | None = None,
               procs: int = 1, prepare: bool = False, entries: Sequence[Entry] | None = None,
               run_id: str = "") -> Report:
    """Run every check on every host of `cluster` (one probe per host, `cluster.ssh.fanout` at once);
    deep: also the device health probes (check `health`). `rank_plan`: the plan the caller made
    (or the PlanError making it gave: check device-rules reports it); None: planned here.
    procs > 1: the probes fan out from that many processes (shards.fan_out_procs), for a caller
    whose pool is still empty and serves only the checks (`orch check`: the connections the
    other processes make are theirs, closed as they exit); the judging stays here.
    `prepare` (`orch up`): the probes read prepare's facts too (Report.prepared), and list what
    each host has of `entries`, up's sync manifest (Report.listed; checkplan.up_files)."""

    t0 = time.monotonic()
    plan = make_check_plan(cluster, rank_plan, full_mesh=full_mesh, deep=deep, prepare=prepare, entries=entries,
                           run_id=run_id)
    results: list[CheckResult] = []

    def emit(rs: Iterable[CheckResult]) -> None:
        for r in rs:
            results.append(r)
            if on_result:
                on_result(r)

    emit(judge_cluster_local(plan))
    runs: dict[str, ProbeRun] = {}

    def done(outcome) -> None:
        run = outcome.value if outcome.ok else ProbeRun(outcome.host, None, outcome.error, "probe")
        runs[outcome.host.name] = run
        emit(judge_host(plan, run))

    # The mesh sources' probes (ssh to every other host) take longest: they start first, alone, so
    # that their handshakes and their probes' start do not queue behind every other host's (the
    # others wait until the sources' probes run, their first output back: at most HEAD_START
    # seconds). At 64 hosts connecting first took ~0.6 s off the launch host's probe, which is the
    # whole check's wall time; at 32, waiting for the probe to run rather than for the connection
    # took ~0.25 s more (the launch host's probe began 0.36 s after its connection, behind 31
    # handshakes). With check mesh skipped nobody waits: no probe is longer.
    first = plan.mesh_from if "mesh" in plan.checks else frozenset()
    waiting = {h.name for h in plan.hosts if h.name in first}
    heads_up = threading.Event()
    if not waiting or len(waiting) == len(plan.hosts):
        heads_up.set()
    lock = threading.Lock()

    def started(name: str) -> None:
        with lock:
            waiting.discard(name)
            if not waiting:
                heads_up.set()

    # Check reach: the launch host's probe opens a listener first thing; the others' probes are sent
    # once its port is known (relay.plan_for waits; their SSH handshakes go on meanwhile).
    relay = reach.Relay.of(plan)
    plan_for = relay.plan_for if relay is not None else None

    def launch_probe(h: Host, on_started) -> ProbeRun:
        assert relay is not None  # probe() calls it only when there is a relay
        run = None
        try:
            run = probe_host(plan, pool, h, on_started=on_started, watch=relay.feed)
            return run
        finally:  # the others wait for nothing more
            relay.done(f"the launch host {h.name}'s probe did not run: {str(run.error).splitlines()[0]}"
                       if run is not None and run.error else f"the launch host {h.name}'s probe printed no listener")

    def probe(h: Host) -> ProbeRun:
        on_started = (lambda: started(h.name)) if h.name in first else None
        if relay is not None and h.name == plan.launch.name:
            return launch_probe(h, on_started)
        if h.name in first:
            return probe_host(plan, pool, h, on_started=on_started, plan_for=plan_for)
        heads_up.wait(HEAD_START)
        return probe_host(plan, pool, h, plan_for=plan_for)

    ssh = cluster.ssh
    budget = ssh.connect_timeout * ssh.retries + 2.0 * ssh.retries + ssh.command_timeout + 5 + HEAD_START
    if relay is not None:
        budget += relay.wait
    if procs > 1 and not any(h.jump for h in plan.hosts):  # jump hosts: one connection to each, in one process
        keep = set(first) | ({plan.launch.name} if relay is not None else set())
        fan_out_procs(plan.hosts, probe, procs=procs, encode=encode_run, decode=decode_run, limit=ssh.fanout,
                      timeout=budget, on_done=done, keep=keep, gate=heads_up, gate_timeout=HEAD_START,
                      child_fn=lambda h: probe_host(plan, pool, h, plan_for=plan_for),
                      child_exit=getattr(pool, "close", None),
                      late=relay.encode if relay is not None else None,
                      child_late=relay.decode if relay is not None else None)
    else:
        fan_out(plan.hosts, probe, limit=ssh.fanout, timeout=budget, on_done=done)
    ordered = [runs[h.name] for h in plan.hosts]
    emit(judge_across(plan, ordered))
    order = {c: i for i, c in enumerate(KNOWN_CHECKS)}
    hidx = {h.name: i for i, h in enumerate(plan.hosts)}
    results.sort(key=lambda r: (order.get(r.check, 99), hidx.get(r.host, len(hidx)) if r.host else len(hidx)))
    hccn = {n: c for n, c in hccn_confs(ordered).items() if c is not None}
    prepared = {r.host.name: f for r in ordered if (f := facts(plan, r.sections)) is not None} if prepare else {}
    return Report(results, tuple(h.name for h in plan.hosts), time.monotonic() - t0, hccn, prepared,
                  listings(ordered))


def listings(runs: Sequence[ProbeRun]) -> dict[str, dict]:
    """{host: what its probe listed for sync (ProbeRun.listed)}, the hosts that listed it whole."""
    return {r.host.name: r.listed for r in runs if r.listed is not None}


def encode_run(run: ProbeRun) -> dict:
    """A ProbeRun as JSON (from a fan-out process; decode_run makes it again)."""
    return {"sections": None if run.sections is None else [[x.name, x.body, x.rc] for x in run.sections.values()],
            "error": None if run.error is None else encode_error(run.error), "stage": run.stage,
            "t_send": run.t_send, "t_recv": run.t_recv, "connect_time": run.connect_time,
            "addresses": None if run.addresses is None else sorted(run.addresses), "listed": run.listed}


def decode_run(host: Host, rec: dict) -> ProbeRun:
    secs = rec["sections"]
    return ProbeRun(host, None if secs is None else {n: probes.Section(n, body, rc) for n, body, rc in secs},
                    None if rec["error"] is None else decode_error(rec["error"]), rec["stage"], rec["t_send"],
                    rec["t_recv"], rec["connect_time"],
                    None if rec["addresses"] is None else frozenset(rec["addresses"]), rec["listed"])


def resolve_address(address: str) -> frozenset[str] | None:
    """An inventory address as IPs, resolved on this machine (None: a DNS name that does not resolve)."""
    try:
        return frozenset({str(ipaddress.ip_address(address))})
    except ValueError:
        pass
    try:
        return frozenset(str(ai[4][0]) for ai in socket.getaddrinfo(address, None))
    except OSError:
        return None


# --------------------------------------------------------------------------- judging


def _host_message(err: OrchError, host: Host) -> str:
    msg = err.message
    prefix = f"{host.name}: "
    if msg.startswith(prefix):
        msg = msg[len(prefix):]
    return msg + (f"; {err.hint}" if err.hint else "")


def applies(plan: CheckPlan, check: str, host: Host) -> bool:
    """Does this per-host check have a result for this host?"""
    c = registered_check(check)
    return check in plan.checks and c.judge is not None and c.applies(plan, host)


def judge_host(plan: CheckPlan, run: ProbeRun) -> list[CheckResult]:
    """Every per-host result of one host, from its ProbeRun (pure). A host that gave no sections
    fails `ssh`, and each other check that applies to it is an error ("not checked")."""
    host = run.host
    applicable = [c for c in registered() if applies(plan, c.name, host)]
    if run.sections is None:
        err = run.error or HostError(host.name, "no answer")
        if run.stage == "connect":
            why = "not checked: SSH to the host failed"
            msg = _host_message(err, host)
            if f"{host.user}@{host.ssh_address}" not in msg:
                msg = f"{host.route}: {msg}"
        else:
            why = "not checked: the probe did not complete on the host"
            msg = f"connected to {host.target} but the probe failed: {_host_message(err, host)}"
        return [result("ssh", host, "fail", msg) if c.name == "ssh" else result(c.name, host, "error", why)
                for c in applicable]
    out: list[CheckResult] = []
    for c in applicable:
        assert c.judge is not None  # `applicable` takes only checks with a judge
        try:
            out += c.judge(plan, run)
        except (Missing, ProbeError) as exc:
            out.append(result(c.name, host, "error", str(exc)))
    return out


def judge_across(plan: CheckPlan, runs: Sequence[ProbeRun]) -> list[CheckResult]:
    """Cluster-wide results from every host's probe output (hosts that gave none are left out)."""
    ok = [r for r in runs if r.sections is not None]
    out: list[CheckResult] = []
    for c in registered():
        if c.across is not None and c.name in plan.checks:
            out += c.across(plan, ok)
    return out


def judge_cluster_local(plan: CheckPlan) -> list[CheckResult]:
    """Checks that need no host: the plan's rules, and the files to sync existing here."""
    out: list[CheckResult] = []
    for c in registered():
        if c.local is not None and c.name in plan.checks:
            out += c.local(plan)
    return out
