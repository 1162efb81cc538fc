"""orch as a library: what the commands do, without printing or exiting.

    import orchestrator as orch

    cluster = orch.load("cluster.yaml")              # or load(path, inventory="lab/inventory.yaml")
    report = orch.check(cluster)                     # report.ok, report.results
    rp = orch.plan(cluster)                          # rp.ranks, rp.hosts
    result = orch.up(cluster)                        # result.state, result.run.id, result.exit_code
    for chunk in orch.logs(result.run.id, rank=0):   # rank 0's output, as bytes
        ...
    orch.status(result.run.id).state                 # read from the cluster
    orch.down(result.run.id)

Errors are `orchestrator.errors.OrchError`s (each with `.exit_code` and a message saying what to
do); progress goes to an `Events` object (`lifecycle.Events`: step, progress, output, warning)
when one is given. The CLI (`cli.py`) is a layer over these functions that prints.

Each function imports what it needs when it is called (start-up time: `orch status` does not load
what `up` needs), so the imports here sit inside the functions.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from .errors import Interrupted, PlanError, PreflightFailed, SpecError, UsageError
from .rankplan import RankPlan
from .runs import Run
from .model import Cluster

if TYPE_CHECKING:  # the lifecycle (and all it imports) is loaded by the functions that run one: not by `check`
    from .lifecycle import Events, Lifecycle, RunEnd

__all__ = ["Events", "LogStream", "PlanOutput", "UpResult", "check", "down", "load", "logs", "plan", "plan_files",
           "probe_script", "progress", "replaced_plan", "collect", "report", "slurm_nodes", "status", "up"]


def __getattr__(name: str) -> Any:
    if name == "Events":  # orch.Events, api.Events: lifecycle.Events, loaded on first use
        from .lifecycle import Events

        return Events
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load(path: str | os.PathLike = "cluster.yaml", inventory: str | os.PathLike | None = None,
         hosts: str | None = None) -> Cluster:
    """The cluster file, validated (SpecError lists every problem with file and line);
    `inventory` replaces its own (relative to the current directory; None: ORCH_INVENTORY when
    set, as for the CLI's -i), `hosts` narrows it (names, ranges, groups: as --hosts)."""
    from .spec import load_cluster

    if inventory is None:
        inventory = os.environ.get("ORCH_INVENTORY") or None
    return load_cluster(path, inventory=inventory).select(hosts)


def plan(cluster: Cluster) -> RankPlan:
    """The rank plan (PlanError when a device or launcher rule is broken). Touches no host; for
    a Slurm inventory, planned on placeholder nodes node1..nodeN."""
    from .rankplan import make_plan

    if cluster.slurm is None:
        return make_plan(cluster)
    from . import slurm  # (only for a Slurm inventory: ~6 ms of every other orch up's start)

    return make_plan(slurm.placeholder(cluster))


@dataclass
class PlanOutput:
    """`plan_files`: the plan (on placeholder nodes node1..nodeN for a Slurm inventory: `cluster`),
    every file `orch up` would use ({name: text}), why the rank table is not among them
    (`missing`: its device IPs or super devices are not known without `probe`), and for Slurm
    the commands orch would run there."""

    cluster: Cluster
    plan: RankPlan
    files: dict[str, str]
    missing: PlanError | None = None
    slurm_commands: dict | None = None


def plan_files(cluster: Cluster, *, replace: Mapping[str, str] | None = None, probe: bool = False) -> PlanOutput:
    """`orch plan --out`: the plan and every file and command `orch up` would use; `replace`
    {host: spare}: as the run's head renders them with those spares in those hosts' places;
    `probe`: read on the hosts the device IPs and super devices the inventory lacks (the only
    thing that touches a host)."""
    import json

    from . import prepare
    from .launchers import show
    from .logins import is_root
    from .rankplan import make_plan
    from .transport import Pool

    slurm_cmds = None
    if cluster.slurm is not None:   # planned on placeholder nodes, as `plan` does
        from . import slurm

        slurm_cmds = slurm.plan_commands(cluster)
        cluster, probe = slurm.placeholder(cluster), False
    rp = replaced_plan(make_plan(cluster), replace or {})
    got = prepare.plan_facts(cluster, rp, probe=probe, pool=lambda: Pool(cluster))
    files = show.plan_files(cluster, got.plan, device_ips=got.device_ips, root=is_root(user=rp.launch_host.user))
    if slurm_cmds is not None:
        files["slurm.json"] = json.dumps(slurm_cmds, indent=2) + "\n"
    return PlanOutput(cluster, got.plan, files, got.missing, slurm_cmds)


def replaced_plan(rp: RankPlan, pairs: Mapping[str, str]) -> RankPlan:
    """The plan as the run's head makes it when each host of `pairs` is lost and its spare takes
    its place (UsageError for a pair that cannot be)."""
    from .rankplan import replaced

    spares = {h.name: h for h in rp.spares}
    taken: set[str] = set()
    for old, new in pairs.items():
        item = f"{old}={new}"
        if new not in spares:
            raise UsageError(f"--replace {item}: {new} is not a spare of this cluster",
                             hint="spares are " + (", ".join(spares) or "none (inventory: spares: N or spare: true)"))
        if old not in {h.name for h in rp.hosts}:
            raise UsageError(f"--replace {item}: {old} runs no ranks in this plan")
        if not rp.can_replace(old, spares[new]):
            raise UsageError(f"--replace {item}: {new} cannot take {old}'s place (the launch host is never "
                             "replaced; a spare needs the same devices)")
        if new in taken:
            raise UsageError(f"--replace {item}: {new} already takes another host's place")
        taken.add(new)
    return replaced(rp, dict(pairs)) if pairs else rp


def check(cluster: Cluster, *, full_mesh: bool = False, deep: bool = False, procs: int = 1):
    """Preflight on every host (checks.Report: `.ok`, `.results`, `.problems()`). `procs`: the
    probes fan out from that many processes (shards.procs_for says how many for a host count;
    forking is for a process with no threads yet, as `orch check` is)."""
    from .checks import run_checks, try_plan
    from .transport import Pool

    with Pool(cluster) as pool:
        return run_checks(cluster, pool, try_plan(cluster), full_mesh=full_mesh, deep=deep, procs=procs)


def probe_script(cluster: Cluster, host: str, *, full_mesh: bool = False, deep: bool = False) -> str:
    """The probe script `check` runs on `host` (a name or address), as it would run it."""
    from .checks import probe_for
    from .hostsets import fold

    match = [h for h in cluster.hosts if host in (h.name, h.address)]
    if not match:
        raise UsageError(f"--print-probe {host!r}: no such host", hint=f"hosts are: {fold(h.name for h in cluster.hosts)}")
    return probe_for(cluster, match[0].name, full_mesh=full_mesh, deep=deep)


@contextmanager
def slurm_nodes(cluster: Cluster, slurm_job: str | None = None,
                on_pending: Callable[[str, str], None] | None = None) -> Iterator[Cluster]:
    """A Slurm inventory with nodes: those of the running job `slurm_job`, or of a brief allocation
    made now and released when the block ends (`on_pending(job id, why)` while it queues). Any other
    inventory as it is (`slurm_job` is then a UsageError)."""
    if cluster.slurm is None:
        if slurm_job is not None:
            raise UsageError("--slurm-job: this inventory lists its hosts; it does not use Slurm")
        yield cluster
        return
    from . import slurm  # (only here: ~30 ms of every other orch check's start)

    if slurm_job is not None:
        client = slurm.Client(cluster)
        try:
            info = client.job(slurm_job)
            if info.state != "RUNNING":
                raise UsageError(f"--slurm-job {slurm_job}: the job is {info.state or 'unknown to Slurm'}, not RUNNING")
            nodes = slurm.with_nodes(cluster, info, client.addresses(info.nodes))
        finally:
            client.close()
        yield nodes
        return
    with slurm.Allocation.request(cluster, on_pending or (lambda jid, why: None)) as alloc:
        yield alloc.cluster


@dataclass
class UpResult:
    """What `up` ended with: the run (its record under .orch/runs/), the outcome, and the
    lifecycle that followed it (log tails)."""

    run: Run
    outcome: RunEnd
    lifecycle: Lifecycle

    @property
    def state(self) -> str:
        return self.outcome.state

    @property
    def logs_missing(self) -> list[str]:
        """Hosts whose logs could not be kept here (the hosts still have them)."""
        return list(self.run.data.get("logs_incomplete") or [])

    @property
    def exit_code(self) -> int:
        """As `orch up` exits: 0 succeeded (or detached); 5 succeeded but logs here are incomplete;
        130 interrupted or stopped; 1 otherwise."""
        if self.state == "detached":
            return 0
        if self.state == "succeeded":
            return 5 if self.logs_missing or self.lifecycle.write_error else 0
        return 130 if self.state in ("interrupted", "stopped") else 1


class Terminated(KeyboardInterrupt):
    """SIGTERM to the controller (the CLI raises it from its handler): `up` stops the run, as
    for Ctrl-C, and says which it was."""


def up(cluster: Cluster, *, detach: bool = False, skip_checks: bool = False, force: bool = False,
       follow_rank: int = 0, show_output: bool = True, events: Events | None = None,
       on_finishing: Callable[[], object] | None = None) -> UpResult:
    """Check, render, distribute, launch, follow (unless `detach`) and gather: `orch up`.

    PreflightFailed (its `.report` holds the check results) or another OrchError when nothing
    was started; otherwise an UpResult, whatever the job did. `follow_rank`: whose output goes
    to `events.output` (with `show_output`; without it, nobody's). `on_finishing` is called once the run is being stopped
    and gathered (the CLI ignores SIGTERM from then on). KeyboardInterrupt while following stops
    every rank (state `interrupted`); while queued for Slurm, the request is cancelled and
    Interrupted raised."""
    from .lifecycle import Events

    events = events or Events()
    rp = plan(cluster)  # fails before queueing
    if not 0 <= follow_rank < rp.size:
        raise UsageError(f"--follow-rank {follow_rank}: the job has ranks 0..{rp.size - 1}")
    follow = follow_rank if show_output else None
    if cluster.slurm is None:
        for w in rp.warnings:
            events.warning(w)
        return _up_on(cluster, rp, events, None, skip_checks, force, detach, follow, on_finishing)
    from . import slurm  # (only for a Slurm inventory)
    from .hostsets import fold
    from .rankplan import make_plan
    from .supervisor import batch_grace

    events.step(f"asking Slurm for {cluster.slurm.allocated} node(s)"
                + (f" ({cluster.slurm.spares} of them spares)" if cluster.slurm.spares else ""))
    queued = True
    try:
        with slurm.Allocation.request(cluster, lambda jid, why: events.step(
                f"Slurm job {jid} is pending ({why}); Ctrl-C cancels it")) as alloc:
            queued = False
            events.step(f"Slurm job {alloc.job.job_id}: {len(alloc.job.nodes)} node(s) {fold(alloc.job.nodes)}")
            rp = make_plan(alloc.cluster)
            for w in rp.warnings:
                events.warning(w)
            result = _up_on(alloc.cluster, rp, events, alloc, skip_checks, force, detach, follow, on_finishing)
            if result.state == "detached":
                alloc.keep()
            else:  # the job ends by itself once the supervisors have; cancel what is left
                info = alloc.release(batch_grace(cluster) + 10 if result.lifecycle.started else 0)
                if info.live:
                    events.warning(f"Slurm job {info.job_id} is still {info.state}; cancel it with "
                                   f"`scancel {info.job_id}`")
            return result
    except KeyboardInterrupt:
        if not queued:
            raise
        raise Interrupted("interrupted while queued: the Slurm request was cancelled") from None


def _up_on(cluster, rp, events, alloc, skip_checks, force, detach, follow_rank, on_finishing) -> UpResult:
    """`up` once the hosts are known."""
    from . import launchers, lifecycle, sync
    from . import prepare as preparing
    from .runs import create_run, new_run_id
    from .transport import Pool

    # the run's id, chosen now: each member's check may stay to be its supervisor (checks/reach.py
    # HOLD_PY), and a supervisor is found by the id it was started with
    planned = new_run_id()
    # what is synced, read once: the probe lists it on the hosts (or prepare does, with
    # --skip-checks) and sync sends what they lack; unreadable: the check says why, else this
    try:
        entries, aside = sync.job_files(cluster)
    except SpecError:
        if skip_checks:
            raise
        entries, aside = None, []
    said = sync.set_aside_message(aside)
    if said:
        events.warning(said)
    with Pool(cluster) as pool:
        report = None
        if not skip_checks:
            from . import checks

            events.step(f"checking {len(cluster.hosts)} host(s)")
            # the probes read prepare's facts too (report.prepared): no round trip of its own
            report = checks.run_checks(cluster, pool, rp, prepare=True, entries=entries, run_id=planned)
            if not report.ok:
                # job.sync that cannot be read (entries None) fails `up --skip-checks` too: not offered
                exc = PreflightFailed("preflight failed: nothing was started",
                                      hint="fix the problems above" + ("" if entries is None else
                                                                       ", or pass --skip-checks to launch anyway"))
                exc.report = report
                raise exc
        if entries is None:   # checks.skip has files: nothing said why job.sync cannot be read
            entries = sync.job_manifest(cluster)
        # hccn.conf once per host: what the check's probe read there, else read now
        rp, device_ips = preparing.launch_facts(cluster, rp, pool, report.hccn if report is not None else None)
        prepared = preparing.prepare(cluster, rp, pool, force=force,
                                     known=report.prepared if report is not None else None,
                                     listing=preparing.sync_listing(cluster, entries))
        for other, hosts in prepared.live.items():   # --force
            events.step(f"--force: stopping run {other} on {', '.join(hosts)} (workdir {cluster.job.workdir})")
            lifecycle.stop_run(cluster, rp, pool, other, "`orch up --force` of another run")
        run = create_run(cluster, rp.to_dict(), run_id=planned)
        if run.id != planned:   # taken meanwhile (the same second and random part): nothing held is of this run
            pool.release_held()
        if alloc is not None:
            run.data["slurm"] = alloc.record()
            run.save()
        run.hold_controller()  # `orch down` from elsewhere can tell this process still follows the run
        launch = launchers.build(cluster, rp, run.id, root=prepared.root, device_ips=device_ips,
                                 interfaces=prepared.interfaces, aarch64=prepared.aarch64,
                                 head_interface_address=prepared.addresses.get(rp.launch_host.name),
                                 share=prepared.share)
        run_lifecycle = lifecycle.Lifecycle(cluster, rp, run, pool, events, follow_rank=follow_rank)
        outcome, stop_reason = None, None
        try:
            listed = {**(report.listed if report is not None else {}), **prepared.listed}
            # the supervisors' python3 start, unpack and import while the code syncs
            run_lifecycle.start(launch, prepared.agent, sync=lambda: run_lifecycle.distribute(
                launch, entries, listed, prepared.share))
            pool.release_held()   # any a start did not take (none, unless one fell back): its process exits
            outcome = lifecycle.RunEnd("detached") if detach else run_lifecycle.follow()
        except KeyboardInterrupt as exc:
            stop_reason = "a SIGTERM to `orch up`" if isinstance(exc, Terminated) else "Ctrl-C in `orch up`"
            outcome = lifecycle.RunEnd("interrupted", f"stopped by {stop_reason}: every rank was stopped")
        except lifecycle.LaunchError as exc:
            outcome = lifecycle.RunEnd("failed", str(exc))
        finally:
            if on_finishing is not None:
                on_finishing()
            if outcome is None:
                outcome = lifecycle.RunEnd("failed", "orch itself failed; every rank was stopped")
            if outcome.state != "detached":
                if run_lifecycle.started and outcome.view is None:  # not ended on the cluster's word: stop it
                    events.step("stopping every process of the run")
                    # the head says "stopped by <why>"
                    why = stop_reason or f"`orch up`, as {outcome.message}"
                    stopped = run_lifecycle.stop(why)
                    for host, why_not in stopped.failed.items():
                        events.warning(f"{host}: could not stop: {why_not}; once it is reachable, run "
                                       f"`orch down --run {run.id}`")
                    outcome.view = run_lifecycle.status(stopped)
                run_lifecycle.gather()
            run_lifecycle.finish(outcome)
    return UpResult(run, outcome, run_lifecycle)


def status(run_id: str | None = None, root: str | os.PathLike = ".", *, cluster: Cluster | None = None):
    """A run's state as its supervisors record it on the cluster (runstate.RunView: `.state`,
    `.ranks`, `.exit_codes`, `.run_id`); default: the latest run started from `root`. With
    `cluster`, the latest run in its workdir (or run `run_id`, when it is not recorded in `root`),
    asked of its launch host: works on a machine that never ran `orch up` (a Slurm inventory:
    its latest `orch-<name>` job)."""
    from .recorded import cluster_status, run_status
    from .runs import load_run, recorded

    if cluster is not None and (run_id is None or not recorded(run_id, cwd=Path(root).absolute())):
        if cluster.slurm is not None:
            from . import slurm

            cluster = slurm.latest(cluster)
        from .rankplan import make_plan  # the job's own nodes (api.plan would show placeholders)

        rid, view = cluster_status(cluster, make_plan(cluster), run_id)
        view.run_id = rid
        return view
    run = load_run(run_id, cwd=Path(root).absolute())
    view = run_status(run)
    view.run_id = run.id
    return view


def progress(run_id: str | None = None, root: str | os.PathLike = "."):
    """A live run's state and figures for `orch top`: the launch host's document alone (one round
    trip to one host; no scan of every host's processes, which `status` does to find orphans).
    When that document cannot be read, is stale (its supervisor gone) or the run has ended: status()."""
    import json
    import time

    from . import runstate
    from .errors import OrchError
    from .hostlayout import run_dir
    from .runs import load_run
    from .supervisor import lost_after
    from .transport import Pool

    run = load_run(run_id, cwd=Path(root).absolute())
    cluster = run.cluster()
    try:
        with Pool(cluster) as pool:
            res = pool[run.plan().launch_host].run(
                ["cat", f"{run_dir(cluster, run.id)}/state.json"]).check("reading the run's state")
        doc = json.loads(res.stdout)
        fresh = isinstance(doc, dict) and time.time() - float(doc.get("updated") or 0) < max(15.0, lost_after(cluster))
    except (OrchError, ValueError, TypeError):
        fresh = False
    if not fresh or doc.get("role") == "member":
        return status(run.id, root)
    view = runstate.from_head(doc)
    if view.final:
        return status(run.id, root)
    view.run_id = run.id
    return view


def down(run_id: str | None = None, root: str | os.PathLike = "."):
    """Stop every process of the run on every host, gather its logs, record it (idempotent):
    ({host: what was done}, {host: why it could not be stopped}, the final RunView)."""
    from .recorded import run_down
    from .runs import load_run

    return run_down(load_run(run_id, cwd=Path(root).absolute()))


class LogStream:
    """`api.logs`'s blocks: iterate it. Once it ends, `ok` is False when, following (`follow`),
    a selected rank failed (as `orch logs --follow` then exits 1)."""

    def __init__(self, blocks: Iterator[bytes], follower=None):
        self._blocks, self._follower = blocks, follower

    def __iter__(self) -> Iterator[bytes]:
        return self._blocks

    @property
    def ok(self) -> bool:
        return self._follower is None or self._follower.exit_ok()


def logs(run_id: str | None = None, rank: int | None = 0, root: str | os.PathLike = ".", *,
         host: str | None = None, follow: bool = False, tail: int | None = None,
         attempt: int | None = None) -> LogStream:
    """Rank `rank`'s output, in blocks, exactly as `orch logs --rank N` writes it (fetched from
    its host when not here yet); rank None: every rank's, each line prefixed with its rank;
    `host`: only the ranks on those hosts (a name or address, or names and ranges)."""
    from . import runlogs as _logs
    from .runs import load_run

    run = load_run(run_id, cwd=Path(root).absolute())
    ranks = _logs.select_ranks(run, rank, host)
    if attempt is not None and attempt < 1:
        raise UsageError(f"--attempt {attempt}: attempts are numbered from 1")
    if attempt is not None and attempt > run.attempt and run.finished and run.data.get("attempts"):
        # the head's word (a running run may restart yet; a record without it says nothing of them)
        raise UsageError(f"--attempt {attempt}: run {run.id} had {run.attempt} attempt{'s' if run.attempt != 1 else ''}")
    follower = _logs.Follow(run, ranks, attempt or 1) if follow else None
    return LogStream(_logs.iter_logs(run, ranks, follow=follow, tail=tail, prefix=rank is None, attempt=attempt,
                                     follower=follower), follower)


def collect(run_id: str | None = None, paths: tuple[str, ...] = (), root: str | os.PathLike = "."):
    """`orch collect`: bring the run's outputs (`paths`, workdir-relative globs; default job.collect)
    here from every host that has them, into .orch/runs/<id>/collect/<host>/; only what changed
    moves, every file checked against its SHA-256. Returns (what was got per host: collect.lines
    says it, the directory)."""
    from . import collect as collecting
    from .runs import load_run
    from .transport import Pool

    run = load_run(run_id, cwd=Path(root).absolute())
    cluster = run.cluster()
    wanted = paths or cluster.job.collect
    if not wanted:
        raise UsageError("nothing to collect: name the paths (orch collect checkpoints/*.ckpt) or set job.collect")
    with Pool(cluster) as pool:
        return collecting.collect(run, cluster, run.plan(), pool, wanted), run.dir / "collect"


def report(run_id: str | None = None, out: str | os.PathLike | None = None, root: str | os.PathLike = "."):
    """`orch report`: the run's self-contained HTML page (default .orch/runs/<id>/report.html) and
    its figures kept as logs/metrics.jsonl: (the page's path, the metrics' path)."""
    from . import report as reporting
    from .runs import load_run

    return reporting.write(load_run(run_id, cwd=Path(root).absolute()), Path(out) if out else None)
