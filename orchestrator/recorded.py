"""Operations on a recorded run (`orch status`, `orch down`, `orch status FILE` with no record
here): the run as the cluster sees it now, a clean stop of exactly this run on every host, and
the record updated when the cluster says it ended. The live run, from start to gather, is
lifecycle.py's; both ask the hosts through its `Lifecycle`."""

from __future__ import annotations

from . import runstate, supervisor
from .errors import OrchError, UsageError
from .lifecycle import Lifecycle, RunEnd, record
from .model import Cluster
from .rankplan import RankPlan
from .runs import Run
from .runstate import RunView
from .transport import Pool


def run_status(run: Run) -> RunView:
    """The run as the cluster sees it now; a run that ended is recorded in run.json."""
    cluster = run.cluster()
    with Pool(cluster) as pool:
        run_lifecycle = Lifecycle(cluster, run.plan(), run, pool)
        view = run_lifecycle.status(ended=run.finished)
        if view.final and not run.finished:
            run.reload()
            if not run.finished:
                run_lifecycle.gather()
                record(run, RunEnd.of(view))
    if not view.final and view.state == "unknown" and run.finished:
        view.state = run.data.get("state") or "unknown"
    return view


def run_down(run: Run) -> tuple[dict[str, str], dict[str, str], RunView]:
    """Stop every process of the run on every host, gather its logs, record it. Idempotent.
    Returns ({host: what was done}, {host: why it could not be stopped}, the run's final view)."""
    cluster = run.cluster()
    with Pool(cluster) as pool:
        run_lifecycle = Lifecycle(cluster, run.plan(), run, pool)
        stopped = run_lifecycle.stop("`orch down`")
        done, failed = dict(stopped.done), dict(stopped.failed)
        job = run.data.get("slurm")
        if job and cluster.slurm is not None:  # the supervisors are gone: the job ends; cancel what is left
            from . import slurm  # lazy: only a Slurm inventory's runs

            try:
                info = slurm.release(slurm.Client(cluster, pool.__getitem__), job["job_id"], supervisor.STOP_GRACE)
                done["slurm"] = f"job {job['job_id']} {info.state or 'gone'}"
            except slurm.SlurmError as exc:
                failed["slurm"] = str(exc)
        view = run_lifecycle.status(stopped)
        run_lifecycle.gather()
        run.reload()
        # the launch host unreached: how the run ended is its head's to say (it may have ended
        # `lost` or `failed` before this stop); nothing is recorded until it can be read
        if not run.finished and run_lifecycle.plan.launch_host.name not in failed:
            if not view.final:
                view.state, view.message = "stopped", "stopped by `orch down`"
            if failed:  # its ranks may run on: say so, never "stopped"
                view.message += (f"; not reached: {', '.join(sorted(failed))} (its ranks' state is unknown: "
                                 f"run `orch down --run {run.id}` again once it is reachable)")
            record(run, RunEnd.of(view))
    return done, failed, view


def run_hosts(names: list[str], doc: dict) -> list[str]:
    """The hosts an ended run's `nothing_left` must cover, as `orch status` of a recorded run
    names them (pure): the cluster file's now (`names`), and the run's own as its head's document
    records them (a host since taken out of the file, a spare that took a host's place)."""
    ran = [*(doc.get("hosts") or ()), *(doc.get("spares") or ()), *(doc.get("spares_lost") or ()),
           *(x.get(k) for x in doc.get("replaced") or () if isinstance(x, dict) for k in ("host", "by")),
           *(r.get("host") for r in doc.get("ranks") or () if isinstance(r, dict))]
    return list(dict.fromkeys([*names, *(n for n in ran if isinstance(n, str))]))


def cluster_status(cluster: Cluster, plan: RankPlan, run_id: str | None = None) -> tuple[str | None, RunView]:
    """The latest run in the cluster's workdir (or run `run_id`), as its launch host's supervisor
    left it: for `orch status FILE` on a machine that never ran `orch up` (no local record)."""
    with Pool(cluster) as pool:
        head = plan.launch_host
        try:
            doc = supervisor.parse_json_line(
                pool[head].run(supervisor.status_script(cluster, run_id)).check("reading status").out)
        except OrchError as exc:  # the run's state is on that host: unknown, not a usage error
            raise OrchError(f"cannot read the run state on the launch host: {exc}",
                            hint="no run of this cluster file is recorded here to fall back on") from None
    if not doc.get("run"):
        raise UsageError(f"no run {run_id + ' ' if run_id else ''}found in {cluster.job.workdir} on {head.name}",
                         hint="start one with `orch up`" if run_id is None else "is the run id whole and right?")
    view = runstate.merge(head.name, {head.name: doc}, {}, [], doc["run"],
                          run_hosts([h.name for h in plan.all_hosts], doc))
    return doc["run"], view
