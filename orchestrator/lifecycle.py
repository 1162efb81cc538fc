"""The controller's part of a run: prepare -> distribute -> start -> follow -> stop -> gather -> record.

Once started, a run supervises itself on the cluster (orchestrator/agent):
fail-fast, restarts, stalls, time-out and lost hosts are decided there, with or without a
controller attached. The controller starts it, follows its events (one long-lived stream
from one host: the head's state changes plus the followed rank's output, pushed as they
happen), asks it to stop (Ctrl-C, `orch down`), gathers logs and records the outcome in
run.json. Every process a run starts carries ORCH_RUN_ID=<run id>; after asking the head,
stopping sweeps exactly those processes on every host, as a last resort.

Nothing here prints: progress goes to an `Events` object the CLI provides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Mapping

from . import runstate, supervisor, top
from .devices import HccnDevice
from .errors import LocalWriteError, OrchError, PreflightFailed, UsageError
from .fanout import Results, fan_out
from .launchers import Launch, recorded_commands, run_dir
from .plan import RankPlan
from .render import is_root
from .runs import Run
from .runstate import RunView
from .model import Cluster
from .transport import Pool


class Events:
    """What the lifecycle reports. The CLI subclasses this to print; the default is silent."""

    def step(self, message: str) -> None: ...
    def progress(self, running: int, exited: int, total: int, elapsed: float, detail: str = "") -> None: ...
    def output(self, rank: int, data: bytes) -> None: ...
    def warning(self, message: str) -> None: ...


@dataclass
class RunEnd:
    """How `orch up` left a run: its state, why, its first failure and the last view of its ranks."""
    state: str                       # succeeded | failed | stopped | lost | stalled | timeout | interrupted | detached
    message: str = ""
    first_failure: dict | None = None
    view: RunView | None = None

    @property
    def exit_codes(self) -> dict[int, int | None]:
        return self.view.exit_codes if self.view else {}

    @classmethod
    def of(cls, view: RunView) -> RunEnd:
        return cls(view.state, view.message, view.first_failure, view)


class LaunchError(OrchError):
    exit_code = 1


class RunConflict(OrchError):
    exit_code = 2


def _fan(cluster: Cluster, hosts, fn: Callable):
    return fan_out(hosts, fn, limit=cluster.ssh.fanout)


@dataclass(frozen=True)
class Prepared:
    """What `prepare` learnt from every host."""

    root: dict[str, bool]                           # {host: the launch user is root}
    interfaces: dict[str, tuple[str, str | None]]   # {host: (job.interface there, its IPv4 network)}
    arch: dict[str, str | None] = field(default_factory=dict)  # {host: uname -m}
    addresses: dict[str, str] = field(default_factory=dict)    # {host: its IPv4 address on job.interface}

    @property
    def aarch64(self) -> bool:
        return any(a == "aarch64" for a in self.arch.values())


def ask_prepare(cluster: Cluster, plan: RankPlan, pool: Pool, hosts) -> Results[dict]:
    """prepare's round trip, one per host of `hosts`: {host: Outcome of its parsed reply}
    (supervisor.parse_prepare)."""
    script = supervisor.prepare_script(cluster, plan.launch_host.cluster_address)
    return _fan(cluster, hosts, lambda h: supervisor.parse_prepare(
        pool[h].run(script).check("preparing the launch").out))


def prepare(cluster: Cluster, plan: RankPlan, pool: Pool, *, force: bool = False,
            events: Events | None = None, known: Mapping[str, dict] | None = None) -> Prepared:
    """What must hold before anything is written: who we are there (root or not), job.interface
    there, python3 for the supervisor, and no other live run in the workdir (unless `force`,
    which stops it). A host it cannot use: PreflightFailed (exit 3), as nothing was started.
    `known`: {host: its facts} as up's check probe read them (checks.Report.prepared); the
    other hosts are asked now, one round trip each (ask_prepare)."""
    from . import probes

    events = events or Events()
    known = dict(known or {})
    need = [h for h in plan.all_hosts if h.name not in known]
    if need:
        res = ask_prepare(cluster, plan, pool, need)
        res.raise_if_failed(PreflightFailed, "cannot reach every host; nothing was started")
        known.update(res.succeeded)
    facts = {h.name: known[h.name] for h in plan.all_hosts}
    problems = []
    for name, f in facts.items():
        problem = supervisor.python_problem(f["python"])
        if problem:
            problems.append(f"{name}: {problem}")
    interfaces: dict[str, tuple[str, str | None]] = {}
    addresses: dict[str, str] = {}
    for name, f in facts.items():
        got = f["interface"]
        problem = probes.interface_problem(cluster.job.interface, got) if cluster.job.interface else None
        if problem is not None:
            problems.append(f"{name}: job.{problem}")
        elif got is not None:
            interfaces[name] = (got.ifname or "", probes.interface_network(got))
            addresses[name] = got.address
    if problems:
        raise PreflightFailed("cannot supervise the run; nothing was started:\n" + "\n".join(f"  {p}" for p in problems))
    live: dict[str, list[str]] = {}
    for name, f in facts.items():
        if f["live"]:
            live.setdefault(f["live"], []).append(name)
    for run_id, hosts in live.items():
        where = f"{', '.join(hosts)} (workdir {cluster.job.workdir})"
        if not force:
            raise RunConflict(f"run {run_id} is still running on {where}; a second run there would mix "
                              "or overwrite its logs",
                              hint=f"stop it with `orch down --run {run_id}` (from the directory that started "
                                   "it), wait for it to end, or pass --force to stop it first")
        events.step(f"--force: stopping run {run_id} on {where}")
        stop_run(cluster, plan, pool, run_id, "`orch up --force` of another run")
    return Prepared({n: is_root(uid=f["uid"]) for n, f in facts.items()}, interfaces,
                    {n: f["arch"] for n, f in facts.items()}, addresses)


@dataclass(frozen=True)
class Stopped:
    """What stop_run did: {host: what was done}, {host: why it could not be stopped}, and each
    swept host's `agent.py status` document, read in the sweep's own round trip (Lifecycle.status
    takes it instead of asking again)."""

    done: dict[str, str]
    failed: dict[str, str]
    docs: dict[str, dict]


def stop_run(cluster: Cluster, plan: RankPlan, pool: Pool, run_id: str, reason: str,
             lost: AbstractSet[str] = frozenset()) -> Stopped:
    """Stop every process of a run on every host: ask its head (it stops every host, and
    records why), then sweep what is left on each host (TERM, then KILL) and read its state."""
    reachable = [h for h in plan.all_hosts if h.name not in lost]
    wait = supervisor.STOP_GRACE + 10
    for h in reachable[:3]:  # any host of the run can reach its head
        try:
            res = pool[h].run(supervisor.agent_argv(cluster, run_id, "stop", reason),
                              env={"ORCH_STOP_WAIT": str(int(wait))}, timeout=wait + cluster.ssh.command_timeout)
            if res.ok:
                break
        except OrchError:
            continue
    script = supervisor.sweep_status_script(cluster, run_id)
    res = _fan(cluster, reachable, lambda h: supervisor.parse_sweep_status(pool[h].run(
        script, timeout=supervisor.STOP_GRACE + cluster.ssh.command_timeout).check("stopping").out))
    return Stopped({n: what for n, (what, _) in res.succeeded.items()}, {n: str(e) for n, e in res.failed.items()},
                   {n: doc for n, (_, doc) in res.succeeded.items()})


class Lifecycle:
    def __init__(self, cluster: Cluster, plan: RankPlan, run: Run, pool: Pool, events: Events | None = None,
                 follow_rank: int | None = 0):
        self.cluster = cluster
        self.plan = plan
        self.run = run
        self.pool = pool
        self.events = events or Events()
        self.follow_rank = follow_rank
        self.started = False
        self.write_error = ""     # this machine could not keep something (a full disk)
        self.view: RunView | None = None
        self.t0 = time.monotonic()

    def _fan(self, fn: Callable, hosts=None):
        return _fan(self.cluster, self.plan.all_hosts if hosts is None else hosts, fn)

    # ---- steps
    def distribute(self, launch: Launch) -> None:
        job = self.cluster.job
        from .sync import manifest, relayed, sync_hosts

        entries = manifest(self.cluster.base_dir, job.sync, str(self.cluster.path), job.sync_exclude)
        for host_files in launch.files.values():
            for name, data in host_files.items():
                self.run.write_file(name, data.decode())
        head = self.plan.launch_host
        self.events.step(f"syncing {sum(e.kind != 'dir' for e in entries)} file(s) to {len(self.plan.all_hosts)} host(s)"
                         + (f", passed on by {head.name}" if relayed(self.plan.all_hosts, head, job.sync_via) else ""))
        results = sync_hosts(self.pool, self.plan.all_hosts, head, job.workdir, entries, launch.files,
                             via=job.sync_via, ssh=self.cluster.ssh, fan=lambda hosts, fn: self._fan(fn, hosts))
        results.raise_if_failed(LaunchError, "distribution failed; nothing was started")
        copied = sum(len(o.value.copied) for o in results.values())
        resent = sorted({rel for o in results.values() for rel in o.value.resent})
        self.events.step(f"synced: {copied} file copies, "
                         f"{sum(len(o.value.unchanged) for o in results.values())} already up to date"
                         + (f"; the launch host's copy of {len(resent)} file(s) was not what it listed, sent again: "
                            f"{', '.join(resent[:3])}" if resent else ""))

    def start(self, launch: Launch) -> None:
        """Start the run's supervisor on the launch host (the head), then on every other host,
        which join it; the head starts the ranks once every host has joined."""
        cfgs = supervisor.configs(self.cluster, self.plan, self.run.id, launch)
        job = self.cluster.job
        self.run.data["commands"] = recorded_commands(cfgs)
        head = self.plan.launch_host
        if self.run.data.get("slurm"):
            return self._start_slurm(cfgs)
        res = self.pool[head].run(supervisor.start_script(cfgs[head.name])).check("starting the run's supervisor")
        status, pid, port, addresses = supervisor.parse_start(res.out)
        if status.startswith("busy:"):
            raise RunConflict(f"run {status[5:]} is still running on {head.name} (workdir {job.workdir})",
                              hint=f"stop it with `orch down --run {status[5:]}`, or pass --force")
        if status != "ok":
            raise LaunchError(f"{head.name}: the run's supervisor did not start: {(res.out + res.err).strip()[-500:]}")
        self.started = True
        # the members try the addresses the head listens on, in its order (an older head names none:
        # then the configuration's own)
        at = {"head_addresses": list(addresses), "head_address": addresses[0]} if addresses else {}
        self.run.data.update(state="running", launched=time.time(), head=head.name, supervisor_port=port,
                             head_addresses=list(addresses or cfgs[head.name]["head_addresses"]),
                             procs=[{"key": "supervisor", "host": head.name, "pid": pid}])
        self.run.save()

        def member(h):
            cfg = dict(cfgs[h.name], head_port=port, **at)
            r = self.pool[h].run(supervisor.start_script(cfg)).check("starting the run's supervisor")
            st, mpid, _, _ = supervisor.parse_start(r.out)
            if st != "ok":
                raise LaunchError(f"{h.name}: the run's supervisor did not start: "
                                  f"{(r.out + r.err).strip()[-500:] if st == 'error' else 'run ' + st[5:] + ' holds the workdir'}")
            return mpid

        members = [h for h in self.plan.all_hosts if h.name != head.name]
        results = self._fan(member, members)
        self.run.data["procs"] += [{"key": "supervisor", "host": n, "pid": o.value} for n, o in results.items() if o.ok]
        self.run.save()
        if results.failed:
            stop_run(self.cluster, self.plan, self.pool, self.run.id, "a host whose supervisor did not start")
        results.raise_if_failed(LaunchError, "could not start on every host (what started was stopped)")
        self.events.step(f"started run {self.run.id}: {self.plan.size} rank(s) on {len(self.plan.hosts)} host(s), "
                         f"supervised from {head.name}")

    def _start_slurm(self, cfgs: dict[str, dict]) -> None:
        """Slurm: stage every node's supervisor, then tell the batch script to start them as job
        steps; wait (bounded) until the head's supervisor runs."""
        res = self._fan(lambda h: self.pool[h].run(supervisor.stage_script(cfgs[h.name])).check(
            "staging the run's supervisor").out)
        if res.failed:
            self._unstage(cfgs)
        res.raise_if_failed(LaunchError, "could not stage the run on every node; nothing was started")
        from . import slurm

        job = self.run.data["slurm"]
        go = slurm.go_path(self.cluster.job.workdir, job["job_id"])
        self.pool[job["batch_host"]].put(supervisor.go_text(self.cluster, self.plan, self.run.id).encode(), go,
                                         mode=0o600)
        self.started = True
        head = self.plan.launch_host
        self.run.data.update(state="running", launched=time.time(), head=head.name, procs=[])
        self.run.save()
        deadline = time.monotonic() + supervisor.START_TIMEOUT
        while True:
            doc = supervisor.parse_json_line(self.pool[head].run(
                supervisor.status_script(self.cluster, self.run.id)).check("reading status").out)
            if doc.get("run") == self.run.id:  # the head has started (a short run may be over already)
                break
            if time.monotonic() > deadline:
                self._unstage(cfgs)
                raise LaunchError(f"the run's supervisors did not start in Slurm job {job['job_id']} within "
                                  f"{supervisor.START_TIMEOUT:g} s; see {run_dir(self.cluster, self.run.id)}"
                                  f"/batch.log on {job['batch_host']}")
            time.sleep(0.1)
        self.run.data["procs"] = [{"key": "supervisor", "host": head.name, "pid": doc.get("agent_pid")}]
        self.run.save()
        self.events.step(f"started run {self.run.id}: {self.plan.size} rank(s) on {len(self.plan.hosts)} node(s) "
                         f"of Slurm job {job['job_id']}, supervised from {head.name}")

    def _unstage(self, cfgs: dict[str, dict]) -> None:
        """Remove the supervisors' configuration files (secret env values) no supervisor read."""
        self._fan(lambda h: self.pool[h].run(["rm", "-f", f"{cfgs[h.name]['rundir']}/"
                                                         f"{supervisor.config_name(h.name)}"]))

    # ---- following
    def follow(self) -> RunEnd:
        """Follow the run's events until it ends: one stream from the host of the followed rank
        (or the launch host), pushed by the cluster. A broken stream is opened again; a launch
        host that stays unreachable for longer than the supervisors wait for each other means the
        run is lost (the other hosts' supervisors stop their ranks themselves)."""
        rank = self.follow_rank if self.follow_rank is not None and self.follow_rank < self.plan.size else None
        host = self.plan.ranks[rank].host if rank is not None else self.plan.launch_host.name
        window = supervisor.lost_after(self.cluster)
        last_ok = time.monotonic()
        from . import logs  # here: `orch status` and `down` of a recorded run need none of it

        copies = logs.Copies(self.run)
        state: dict = {}

        def on_state(doc: dict) -> None:
            state.clear()
            state.update(doc)
            ranks = doc.get("ranks") or []
            running = sum(1 for r in ranks if r.get("state") == "running")
            ended = sum(1 for r in ranks if r.get("end") is not None)
            detail = top.summary(runstate.from_head(doc), time.time()) if doc.get("progress") else ""
            self.events.progress(running, ended, self.plan.size, time.monotonic() - self.t0, detail)

        def on_output(r: int, attempt: int, data: bytes) -> None:
            try:
                copies.add(r, attempt, data)
            except LocalWriteError as exc:  # shown, not kept: the gather at the end says what is missing
                if not self.write_error:
                    self.events.warning(f"{exc.message}; the run goes on, its logs stay on the hosts")
                self.write_error = exc.message
            self.events.output(r, data)

        while True:
            attempt = int(state.get("attempt") or 1)
            args = ["watch", "--to-end"]  # not only until the followed rank has ended: the run's end is pushed too
            if rank is not None:
                args += ["--attempt", str(attempt), "--rank", str(rank), "--offset",
                         f"{rank}={copies.offset(rank, attempt)}"]
                # a spare may run it now: where the head says it runs (its rank records)
                now_at = next((r.get("host") for r in state.get("ranks") or () if r.get("rank") == rank), None)
                host = now_at if isinstance(now_at, str) and now_at in {h.name for h in self.plan.all_hosts} else host
            stream = supervisor.EventStream(on_state, on_output)
            err: OrchError | None = None
            try:
                self.pool[host].run(supervisor.agent_argv(self.cluster, self.run.id, *args),
                                    env={"ORCH_LOST_AFTER": str(int(window))}, sink=stream, timeout=window + 5)
                last_ok = time.monotonic()
            except OrchError as exc:
                err = exc
            if stream.last_state and stream.last_state.get("state") in runstate.FINAL:
                self.view = self._slurm_word(runstate.from_head(stream.last_state))  # gather reads it
                return RunEnd.of(self.view)
            view = self.status()
            if view.final:
                return RunEnd.of(view)
            if self.plan.launch_host.name not in view.unreachable and view.state != "unknown":
                last_ok = time.monotonic()
            if time.monotonic() - last_ok > window:
                why = view.unreachable.get(self.plan.launch_host.name) or (str(err) if err else view.message)
                return RunEnd("lost", f"lost contact with the launch host {self.plan.launch_host.name}: {why}. "
                              "The supervisors on the other hosts stop their ranks when the launch host's is gone; "
                              f"once it is reachable, run `orch down --run {self.run.id}`")
            time.sleep(1.0)

    # ---- the cluster's word
    def status(self, stopped: Stopped | None = None) -> RunView:
        """Every host's supervisor state, merged (one round trip per host). After stop(), pass
        what it returned: the swept hosts' states are taken from it, only the others (lost ones)
        are asked now."""
        docs = stopped.docs if stopped else {}
        unreachable = {n: why.splitlines()[0] for n, why in stopped.failed.items()} if stopped else {}
        hosts = [h for h in self.plan.all_hosts if h.name not in docs and h.name not in unreachable]
        res = self._fan(lambda h: supervisor.parse_json_line(
            self.pool[h].run(supervisor.status_script(self.cluster, self.run.id)).check("reading status").out),
            hosts) if hosts else {}
        docs = {**docs, **{n: o.value for n, o in res.items() if o.ok}}
        docs = {h.name: docs[h.name] for h in self.plan.all_hosts if h.name in docs}
        unreachable = {**unreachable, **{n: str(o.error).splitlines()[0] for n, o in res.items() if not o.ok}}
        self.view = runstate.merge(self.plan.launch_host.name, docs, unreachable,
                                   [r.to_dict() | {"device": r.device_id} for r in self.plan.ranks], self.run.id)
        return self._slurm_word(self.view)

    def _slurm_word(self, view: RunView) -> RunView:
        """A run in a Slurm job: the job's state beside the run's, and Slurm's word on how it
        ended when it ended the run itself (time limit, node failure)."""
        job = self.run.data.get("slurm")
        if job and self.cluster.slurm is not None:
            from . import slurm

            info = slurm.job_view(self.pool.slurm(), job["job_id"])
            if info is not None:
                slurm.apply(view, info)
        return view

    def stop(self, reason: str) -> Stopped:
        return stop_run(self.cluster, self.plan, self.pool, self.run.id, reason,
                        lost=set(self.view.unreachable) if self.view else set())

    def gather(self) -> dict[str, str]:
        """Fetch every rank's new log bytes from every reachable host. Never raises."""
        lost = set(self.view.unreachable) | set(self.view.lost) if self.view else set()
        hosts = [h for h in self.plan.all_hosts if h.name not in lost]
        attempt = self.view.attempt if self.view and self.view.attempt else 1
        from . import logs

        if self.view and self.view.replaced:   # which host ran which rank (logs.gather reads it here)
            self.run.data["replaced"] = self.view.replaced
        out = logs.gather(self.run, self.cluster, self.plan, self.pool, hosts, launcher_attempt=attempt)
        missing = {n: why for n, why in out.items() if why != "ok"}
        missing.update({n: "lost" for n in lost})
        for name, why in missing.items():
            when = "there is space here" if why.startswith("cannot write") else "it is reachable"
            self.events.warning(f"the logs of {name} could not be gathered ({why.splitlines()[0]}); "
                                f"`orch logs` fetches them once {when}")
        self.run.data["logs_incomplete"] = sorted(missing)
        if self.cluster.job.collect:   # job.collect: the run's outputs, from the hosts that gave their logs
            from . import collect

            for line in collect.lines(collect.collect(self.run, self.cluster, self.plan, self.pool,
                                                      self.cluster.job.collect, hosts)):
                self.events.step(line)
        return out

    def finish(self, outcome: RunEnd) -> None:
        """Record the outcome in run.json; a full disk here is said, not a crash (the run's
        state stays on the cluster: `orch status` reads it)."""
        try:
            record(self.run, outcome)
        except LocalWriteError as exc:
            self.write_error = exc.message

    def log_tail(self, rank: int, lines: int = 20) -> str:
        return log_tail(self.run, rank, self.run.attempt if self.view is None else max(1, self.view.attempt), lines)


def record(run: Run, outcome: RunEnd) -> None:
    """The outcome into run.json (atomically)."""
    view = outcome.view
    data: dict[str, Any] = {"state": outcome.state, "message": outcome.message, "first_failure": outcome.first_failure}
    if outcome.state != "detached":
        data["ended"] = time.time()
    else:
        data["state"] = "running"
    if view is not None:
        data.update(exit_codes={str(r["rank"]): r.get("exit_code") for r in view.ranks},
                    signals={str(r["rank"]): r["signal"] for r in view.ranks if r.get("signal")},
                    attempt=max(1, view.attempt), attempts=view.attempts, lost=view.lost,
                    ranks=view.ranks, progress=view.progress, load=view.load,
                    **({"replaced": view.replaced} if view.replaced else {}))
    run.data.update(data)
    run.save()


def log_tail(run: Run, rank: int, attempt: int, lines: int = 20) -> str:
    local = run.local_log(rank, attempt)
    if not local.exists():
        return ""
    with open(local, "rb") as fh:
        fh.seek(max(0, fh.seek(0, 2) - 65536))
        data = fh.read()
    return b"\n".join(data.splitlines()[-lines:]).decode("utf-8", "replace")


# --------------------------------------------------------------------------- device IPs


def read_device_ips(plan: RankPlan, pool: Pool, known: Mapping[str, Mapping[int, HccnDevice]] | None = None,
                    *, what: str = "", timeout: float | None = None) -> dict[str, dict[int, str]]:
    """Device IPs for the rank table: the inventory's `device_ips`, else each host's
    /etc/hccn.conf: as `known` has it (what `orch check`'s probe read there), else read now
    (only from hosts that need it, over the pool's connections). PlanError for what is missing
    (`what` goes before a read error's message: `--probe: `)."""
    from .devices import hccn_ips, read_hccn
    from .plan import device_ips_for

    known = dict(known or {})
    need = [h for h in plan.all_hosts if any(d not in h.device_ips for d in h.devices) and h.name not in known]
    confs = {**known, **(read_hccn(pool, need, what, timeout=timeout) if need else {})}
    return device_ips_for(plan, {n: hccn_ips(c) for n, c in confs.items()})


def read_super_devices(plan: RankPlan, pool: Pool) -> RankPlan:
    """Rank table 1.2 (Atlas A3): the plan with every host's super_device_ids and super_pod_id,
    the inventory's first, else read with npu-smi (`npu-smi info -m`, then `npu-smi info -t
    spod-info -i <card> -c <chip>` per device) on the hosts that need it, over the open
    connections. Anything missing -> PlanError naming host and device (devices.super_devices_for)."""
    from .devices import needs_probe, read_spod, super_devices_for
    from .errors import PlanError

    need = [h for h in plan.all_hosts if needs_probe(h)]
    outcomes = fan_out(need, lambda h: read_spod(pool[h], h), limit=pool.cluster.ssh.fanout)
    outcomes.raise_if_failed(PlanError, "could not run npu-smi on {n} host(s)", brief=True,
                             hint="run `orch check` for the connection problems, or give super_device_ids and "
                                  "super_pod_id in the inventory")
    return super_devices_for(plan, outcomes.succeeded)


# --------------------------------------------------------------------------- a recorded run


def plan_from_run(run: Run) -> RankPlan:
    from .plan import Rank

    hosts = {h.name: h for h in run.hosts()}
    doc = run.data["plan"]
    return RankPlan(ranks=tuple(Rank(**r) for r in doc["ranks"]),
                    hosts=tuple(hosts[h["name"]] for h in doc["hosts"]),
                    launcher=doc["launcher"], platform=doc["platform"],
                    spares=tuple(hosts[h["name"]] for h in doc.get("spares", ()) if h["name"] in hosts))


def run_status(run: Run) -> RunView:
    """The run as the cluster sees it now; a run that ended is recorded in run.json."""
    cluster = run.cluster()
    with Pool(cluster) as pool:
        run_lifecycle = Lifecycle(cluster, plan_from_run(run), run, pool)
        view = run_lifecycle.status()
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
        run_lifecycle = Lifecycle(cluster, plan_from_run(run), run, pool)
        stopped = run_lifecycle.stop("`orch down`")
        done, failed = dict(stopped.done), dict(stopped.failed)
        job = run.data.get("slurm")
        if job and cluster.slurm is not None:  # the supervisors are gone: the job ends; cancel what is left
            from . import slurm

            try:
                info = slurm.release(pool.slurm(), job["job_id"], supervisor.STOP_GRACE)
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
    view = runstate.merge(head.name, {head.name: doc}, {}, [], doc["run"])
    return doc["run"], view


__all__ = ["Events", "LaunchError", "Lifecycle", "RunConflict", "RunEnd", "cluster_status", "prepare",
           "read_device_ips", "read_super_devices", "record", "run_dir", "run_down", "run_status", "stop_run"]
