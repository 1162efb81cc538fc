"""Everything `orch check` decides before any host is touched (CheckPlan): which checks run,
the hosts in the rank plan's order, the launch host, the tools whose versions are compared,
the files `orch up` would sync, who tests ssh to whom."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

from .. import probes
from ..errors import OrchError, PlanError, SpecError
from ..launchers import launcher
from ..logins import share_name
from ..rankplan import RankPlan, make_plan, order_hosts
from ..probes import ReachTarget, SyncFile
from ..model import Cluster, Host
from .names import KNOWN_CHECKS
from ..prepare import sync_listing
from ..sync import Entry, job_manifest, manifest, set_aside, set_aside_message


def active_checks(cluster: Cluster) -> list[str]:
    return [c for c in KNOWN_CHECKS if c not in cluster.checks.skip]


def needed_tools(cluster: Cluster) -> list[str]:
    """Tools the launch cannot do without (their absence everywhere is a fail)."""
    job = cluster.job
    out = ["python", *launcher(cluster).tools]
    if job.platform == "ascend" and not {"mindspore", "torch"} & set(out):  # a framework the launcher names wins
        out.append("mindspore")
    if job.platform == "ascend":
        out.append("cann")
    if job.platform == "gpu":
        out += ["nccl", "cuda-driver"]
    return out


def version_tools(cluster: Cluster) -> list[str]:
    """checks.versions if given, else the defaults for the launcher and platform."""
    if cluster.checks.versions is not None:
        return list(dict.fromkeys(cluster.checks.versions))
    return needed_tools(cluster)


def mesh_sources(hosts: tuple[Host, ...], cluster: Cluster, full_mesh: bool) -> list[Host]:
    """Who tests ssh to the others (hosts in plan order): the launch host when the launcher needs
    host-to-host ssh (mpirun) or when it passes the code on (job.sync_via: launch-host), every host
    with --full-mesh."""
    if len(hosts) < 2 or not (launcher(cluster).needs_mesh or cluster.job.sync_via == "launch-host" or full_mesh):
        return []
    return list(hosts) if full_mesh else [hosts[0]]


def sync_manifest(cluster: Cluster) -> tuple[list[SyncFile], list[str], list[Entry]]:
    """(files orch up will copy, with size and sha256; why job.sync entries cannot be synced; what
    it leaves out, sync.set_aside). Reads local files.

    Uses sync.manifest, entry by entry, so the paths in workdir are exactly the ones `orch up` writes."""

    files: list[SyncFile] = []
    missing: list[str] = []
    aside: list[Entry] = []
    names = launcher(cluster).rendered_names(cluster)
    for entry in cluster.job.sync:
        try:
            got, out = set_aside(manifest(cluster.base_dir, (entry,), str(cluster.path), cluster.job.sync_exclude,
                                          hashed=True), names)
        except SpecError as exc:
            missing += [msg for _, msg in exc.problems]
            continue
        aside += out
        files += [SyncFile(e.rel, e.size, e.sha256 if e.size <= probes.HASH_LIMIT else None)
                  for e in got if e.kind == "file"]
    return files, missing, aside


def up_files(cluster: Cluster, entries: Sequence[Entry] | None) -> tuple[list[SyncFile], list[str],
                                                                         tuple[tuple[str, bool], ...]]:
    """`orch up`'s probe: (the files it will copy, by size and modification time; why job.sync
    cannot be synced; what the probe lists on every host for sync and the files check, the
    listing request). `entries`: up's sync manifest (sync.job_manifest, made once for the probe
    and the sync); None: read here. Nothing is hashed: each host's listing is compared by size
    and mtime, as sync compares it. When job.sync cannot be read: `orch check`'s way (the
    problems, no listing)."""
    if entries is None:
        try:
            entries = job_manifest(cluster)
        except OrchError:
            files, missing, _ = sync_manifest(cluster)   # (job.sync cannot be read: the check fails on that)
            return files, missing, ()
    return ([SyncFile(e.rel, e.size, None, e.mtime_ns) for e in entries if e.kind == "file"], [],
            sync_listing(cluster, entries))


@dataclass(frozen=True)
class CheckPlan:
    """Everything decided before any host is touched (plain data: run.probe_script makes a host's
    script from it, run.judge_host judges with it)."""

    cluster: Cluster
    checks: tuple[str, ...]
    hosts: tuple[Host, ...]  # plan order
    launch: Host
    tools: tuple[str, ...]
    needed: tuple[str, ...]
    manifest: tuple[SyncFile, ...]
    missing_sync: tuple[str, ...]
    set_aside_note: str | None  # `orch check`: what job.sync has that orch writes itself (sync.set_aside_message)
    mesh_from: frozenset[str]
    full_mesh: bool
    rank_plan: RankPlan | PlanError  # the rank plan, or why there is none (check device-rules says)
    prepare: bool = False  # `orch up`'s probe: it reads prepare's facts too (prepare.py)
    reach_token: str = ""  # check reach: this run's random token (the hosts present one half, the listener the other)
    reach: ReachTarget | None = None  # check reach: the launch host's listener, as its probe told (reach.Relay)
    # `orch up` (prepare): what the probe lists in workdir for sync (sync.listing_request; () when
    # job.sync cannot be read here: sync then asks in its own round trip)
    listing: tuple[tuple[str, bool], ...] = ()
    # `orch up` whose launch host tests the mesh (mpirun, the sync relay): the name of the sockets
    # its test keeps the connections open on, for mpirun's and the relay's own ssh (logins.share_name)
    share: str = ""
    # `orch up` (not on Slurm): how long each other host's reach test waits to be its supervisor
    # (reach.HOLD_PY: the start then needs no SSH session of its own); 0: it does not
    hold: float = 0.0
    run_id: str = ""  # `orch up`: the id the run will have (a holding test starts with it: supervisor.run_env)


def make_check_plan(cluster: Cluster, rank_plan: RankPlan | PlanError | None = None, *, full_mesh: bool = False,
                    deep: bool = False, prepare: bool = False, entries: Sequence[Entry] | None = None,
                    run_id: str = "") -> CheckPlan:
    """The check plan for `cluster`. `rank_plan`: the rank plan the caller made (or the PlanError
    making it gave); None: made here. `prepare`: the probe reads `orch up`'s prepare facts too,
    and lists what each host has of the sync (`entries`: up's sync manifest, see up_files)."""
    if rank_plan is None:
        rank_plan = try_plan(cluster)
    checks = tuple(c for c in active_checks(cluster) if deep or c != "health")
    hosts = rank_plan.all_hosts if isinstance(rank_plan, RankPlan) else order_hosts(cluster.hosts)
    listing: tuple[tuple[str, bool], ...] = ()
    aside: list[Entry] = []
    if prepare:
        manifest, missing, listing = up_files(cluster, entries)
    else:
        manifest, missing, aside = sync_manifest(cluster) if "files" in checks else ([], [], [])
    mesh_from = frozenset(h.name for h in mesh_sources(hosts, cluster, full_mesh))
    return CheckPlan(cluster=cluster, checks=checks, hosts=hosts, launch=hosts[0],
                     tools=tuple(version_tools(cluster)), needed=tuple(needed_tools(cluster)),
                     manifest=tuple(manifest), missing_sync=tuple(missing), set_aside_note=set_aside_message(aside),
                     mesh_from=mesh_from,
                     full_mesh=full_mesh, rank_plan=rank_plan, prepare=prepare, reach_token=secrets.token_hex(32),
                     listing=listing,
                     share=share_name(secrets.token_hex(4)) if prepare and hosts[0].name in mesh_from else "",
                     hold=2.0 * cluster.ssh.command_timeout if prepare and run_id and cluster.slurm is None else 0.0,
                     run_id=run_id)


def try_plan(cluster: Cluster) -> RankPlan | PlanError:
    """rankplan.make_plan, its PlanError as a value (orch check reports it as device-rules)."""

    try:
        return make_plan(cluster)
    except PlanError as exc:
        return exc

