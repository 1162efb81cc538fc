"""The controller's part of a live run: distribute -> start -> follow -> stop -> gather -> record
(prepare before it is prepare.py's; status and down of a recorded run are recorded.py's).

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

import threading
import time
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Mapping, TypeVar

from . import runstate, supervisor
from .errors import LocalWriteError, OrchError, RunConflict, SessionRefused
from .fanout import Results, fan_out
from .hostlayout import run_dir
from .launchers import Launch
from .launchers.show import recorded_commands
from .rankplan import RankPlan
from .runs import Run
from .runstate import RunView
from .model import Cluster
from .transport import Pool, Result, Transport
from .agent.layout import START_SILENCE
from .agent.states import rank_ranges


class Events:
    """What the lifecycle reports. The CLI subclasses this to print; the default is silent."""

    def step(self, message: str) -> None: ...
    def progress(self, running: int, exited: int, total: int, elapsed: float, view: RunView | None = None) -> None:
        """While following: how many ranks run and have exited, and the head's latest document
        (`view`: ranks, their progress, the hosts' load) when the counts or the run's state
        change, else once a second (the head's figures themselves: delta.figures_every)."""
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


def _fan(cluster: Cluster, hosts, fn: Callable):
    return fan_out(hosts, fn, limit=cluster.ssh.fanout)


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


T = TypeVar("T")


def _meanwhile(fn: Callable[[], T]) -> Callable[[], tuple[T | None, BaseException | None]]:
    """Call `fn` in a thread of its own; the function returned waits for it and returns (what it
    returned, what it raised: None if nothing), for the caller to raise once its own work is done."""
    got: list = [None, None]

    def call() -> None:
        try:
            got[0] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            got[1] = exc

    thread = threading.Thread(target=call, name="orch-meanwhile", daemon=True)
    thread.start()

    def wait() -> tuple[T | None, BaseException | None]:
        thread.join()
        return got[0], got[1]
    return wait


def _nothing() -> tuple[None, None]:
    """A _meanwhile's wait that has nothing to wait for: no value, nothing raised."""
    return None, None


class _Line:
    """A line some hosts' stdin waits for (_Told): sent once known (send), or never (close). Its
    wait has no timeout of its own: whoever makes one closes it in a `finally` (Lifecycle.start),
    after work that has its own (the sync, the head's start). Meanwhile each reader gives a blank
    line every `keepalive` seconds, which a start skips: a start whose stdin stays silent for
    layout.START_SILENCE seconds starts nothing (the controller is gone: a host's side never
    waits on a dead session for TCP's keepalive)."""

    def __init__(self, keepalive: float = START_SILENCE / 6) -> None:
        self._line = b""
        self._known = threading.Event()
        self.keepalive = keepalive

    @property
    def sent(self) -> bool:
        return bool(self._line)

    def send(self, line: bytes) -> None:
        assert line
        self._line = line
        self._known.set()

    def close(self) -> None:
        self._known.set()

    def reader(self, first: bytes) -> _Told:
        return _Told(self, first)


class _Told:
    """A host's stdin (a transport's Reader): its first bytes, then the line once known, then its end."""

    def __init__(self, line: _Line, first: bytes):
        self.line, self.rest, self.waited = line, first, False

    def read(self, n: int = -1, /) -> bytes:
        if not self.rest and not self.waited:
            if not self.line._known.wait(self.line.keepalive):
                return b"\n"   # still waiting, still here
            self.waited = True
            self.rest = self.line._line
        out, self.rest = (self.rest, b"") if n < 0 else (self.rest[:n], self.rest[n:])
        return out


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
    def distribute(self, launch: Launch, entries: list, listed: Mapping[str, Mapping] | None = None,
                   share: str | None = None) -> None:
        """Sync `entries` (sync.job_manifest) and the rendered files to every host; `listed`: what
        up's check probe (or prepare) listed on each: those hosts are not asked again; `share`:
        the launch host's open ssh connections a relay uses (prepare.Prepared.share)."""
        job = self.cluster.job
        from .sync import relayed, sync_hosts  # lazy: only `orch up` syncs; status and down of a recorded run do not

        # a copy of each rendered file here, once (a rank table is every host's: at 128 hosts it
        # was written, and synced to disk, 128 times)
        for name, data in {n: d for host_files in launch.files.values() for n, d in host_files.items()}.items():
            self.run.write_file(name, data.decode())
        head = self.plan.launch_host
        files = sum(e.kind != "dir" for e in entries)
        said = bool(files) or any(launch.files.values())   # no file synced or rendered: nothing to say
        if said:
            self.events.step(f"syncing {files} file(s) to {len(self.plan.all_hosts)} host(s)"
                             + (f", passed on by {head.name}" if relayed(self.plan.all_hosts, head, job.sync_via)
                                else ""))
        results = sync_hosts(self.pool, self.plan.all_hosts, head, job.workdir, entries, launch.files,
                             via=job.sync_via, ssh=self.cluster.ssh, fan=lambda hosts, fn: self._fan(fn, hosts),
                             listed=listed, share=share)
        results.raise_if_failed(LaunchError, "distribution failed; nothing was started")
        copied = sum(len(o.value.copied) for o in results.values())
        resent = sorted({rel for o in results.values() for rel in o.value.resent})
        if said:
            self.events.step(f"synced: {copied} file copies, "
                             f"{sum(len(o.value.unchanged) for o in results.values())} already up to date"
                             + (f"; the launch host's copy of {len(resent)} file(s) was not what it listed, sent "
                                f"again: {', '.join(resent[:3])}" if resent else ""))

    def start(self, launch: Launch, have_agent: AbstractSet[str] = frozenset(),
              sync: Callable[[], None] = lambda: None) -> None:
        """Start the run's supervisor on the launch host (the head) and on every other host, which
        join it; the head starts the ranks once every host has joined. `have_agent`: the hosts
        that have this orch's agent package (prepare.Prepared.agent): it is not sent there.
        `sync` (the code's, distribute) runs meanwhile: every host's python3 starts, unpacks the
        package and imports it while the code is synced, and the head gets its configuration once
        `sync` has returned (a first sync of 8 hosts waited ~0.3 s more for the supervisors after
        it, shipping and compiling the package); `sync` raising: nothing starts anywhere. (A
        `connection: local` host reads its whole stdin before it runs: its start follows the sync.)

        A host whose SSH server takes one session at a time on a connection (sshd_config
        MaxSessions 1) cannot have both at once: a start refused there waits for the sync's end;
        a sync refused there (a start had the session) ends every start, told nothing, and the
        sync then the starts run one after the other."""
        cfgs = supervisor.configs(self.cluster, self.plan, self.run.id, launch)
        self.run.data["commands"] = recorded_commands(cfgs)
        if self.run.data.get("slurm"):
            sync()
            return self._start_slurm(cfgs)
        synced = threading.Event()
        try:
            return self._start(cfgs, have_agent, sync, synced)
        except OrchError as exc:
            # the hosts where the sync was refused a session (distribute's error says each host's)
            one_at_a_time = [n for n, e in exc.by_host.items() if isinstance(e, SessionRefused)]
            if synced.is_set() or not one_at_a_time:   # (a run that started had synced)
                raise
        self.events.warning(f"{', '.join(one_at_a_time)}: the SSH server takes one session at a time there "
                            "(sshd_config MaxSessions 1): syncing the code, then starting the supervisors, one after "
                            "the other (MaxSessions 2 or more lets orch do both at once)")
        sync()
        self._start(cfgs, have_agent, lambda: None, threading.Event())

    def _start(self, cfgs: dict[str, dict], have_agent: AbstractSet[str], sync: Callable[[], None],
               synced: threading.Event) -> None:
        """start's, with `sync` run while the starts wait (`synced` set once it has returned);
        nothing started when it raises before every member was told the head's port."""
        job = self.cluster.job
        head = self.plan.launch_host
        members = [h for h in self.plan.all_hosts if h.name != head.name]
        # every start goes out now: the members' with their configuration, each then waiting for
        # the head's port and addresses (head_line), which follow on its stdin once the head runs;
        # the head's waits for its configuration until the code is synced. If the head does not
        # start (or the sync fails), their stdin closes and nothing starts there.
        head_conf, told, sync_over = _Line(), _Line(), threading.Event()

        def after_sync_if_refused(start: Callable[[], T]) -> T:
            try:
                return start()
            except SessionRefused:   # the sync had the host's one session: once it has ended
                sync_over.wait()
                if not synced.is_set():   # it failed: nothing starts, nothing to ask
                    raise
                return start()

        def member(h):
            # the python3 of the host's check, when it stayed for it (checks/reach.py HOLD_PY): no
            # SSH session nor python3 start of its own; else a session of its own
            b = supervisor.boot(cfgs[h.name], h.name not in have_agent)
            r = self.pool[h].start_held(b.env, b.args, told.reader(b.package + b.conf))
            if r is None:
                r = after_sync_if_refused(lambda: self.pool[h].run(b.command, stdin=told.reader(b.package + b.conf)))
            r = r.check("starting the run's supervisor")
            st, mpid, _, _ = supervisor.parse_start(r.out)
            if st != "ok":
                raise LaunchError(f"{h.name}: the run's supervisor did not start: "
                                  f"{(r.out + r.err).strip()[-500:] if st == 'error' else 'run ' + st[5:] + ' holds the workdir'}")
            return mpid

        hb = supervisor.boot(cfgs[head.name], head.name not in have_agent)
        # started inside the try that ends them; until then, nothing to wait for
        head_started: Callable[[], tuple[Result | None, BaseException | None]] = _nothing
        members_started: Callable[[], tuple[Results | None, BaseException | None]] = _nothing
        try:
            head_started = _meanwhile(lambda: after_sync_if_refused(
                lambda: self.pool[head].run(hb.command, stdin=head_conf.reader(hb.package))))
            members_started = _meanwhile(lambda: self._fan(member, members))
            try:
                sync()
                synced.set()
            finally:
                sync_over.set()
            head_conf.send(hb.conf)
            res, raised = head_started()
            if raised is not None:
                raise raised
            assert res is not None   # returned, as nothing was raised
            res = res.check("starting the run's supervisor")
            status, pid, port, addresses = supervisor.parse_start(res.out)
            if status.startswith("busy:"):
                raise RunConflict(f"run {status[5:]} is still running on {head.name} (workdir {job.workdir})",
                                  hint=f"stop it with `orch down --run {status[5:]}`, or pass --force")
            if status != "ok":
                raise LaunchError(f"{head.name}: the run's supervisor did not start: {(res.out + res.err).strip()[-500:]}")
            told.send(supervisor.head_line(port, addresses))
        finally:
            head_conf.close()   # not sent: the head starts nothing
            told.close()     # the members not told start nothing
            if not told.sent:   # the sync's or the head's error is the one said, once every start has ended
                got, _ = head_started()
                members_started()
                if got is not None and got.ok and supervisor.parse_start(got.out)[0] == "ok":
                    self.started = True   # the head runs (Ctrl-C came after its start): up stops it
        self.started = True
        self.run.data.update(state="running", launched=time.time(), head=head.name, supervisor_port=port,
                             head_addresses=list(addresses or cfgs[head.name]["head_addresses"]),
                             procs=[{"key": "supervisor", "host": head.name, "pid": pid}])
        # the record names the head as the members start (this process may die meanwhile), saved
        # while they do: at 128 x 8 on a busy machine the save (a 400 KB record) took 0.7-2.7 s
        # when the members waited for it; not waiting for the disk either: the record that ends
        # the run is synced
        saved = _meanwhile(lambda: self.run.save(durable=False))
        try:
            results, raised = members_started()
        finally:
            _, not_saved = saved()
        if raised is not None:
            raise raised
        if not_saved is not None:
            raise not_saved
        assert results is not None   # returned, as nothing was raised
        self.run.data["procs"] += [{"key": "supervisor", "host": n, "pid": o.value} for n, o in results.items() if o.ok]
        self.run.save(durable=False)
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
        from . import slurm  # lazy: only a Slurm inventory's runs

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
                log = f"{run_dir(self.cluster, self.run.id)}/batch.log"
                raise LaunchError(f"the run's supervisors did not start in Slurm job {job['job_id']} within "
                                  f"{supervisor.START_TIMEOUT:g} s; {log} on {job['batch_host']} "
                                  + said(self.pool[job["batch_host"]], log, self.cluster.ssh.command_timeout))
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
        from . import runlogs as logs  # lazy: `orch status` and `down` of a recorded run gather no logs unless the run ended

        copies = logs.Copies(self.run)
        state: dict = {}

        shown: tuple | None = None   # the counts and state last reported

        def counts() -> tuple:
            ranks = state.get("ranks") or []
            return (sum(1 for r in ranks if r.get("state") == "running"),
                    sum(1 for r in ranks if r.get("end") is not None), state.get("state"), state.get("attempt"))

        def report() -> None:   # on a change of the counts, and on the stream's heartbeat (each second)
            nonlocal shown
            shown = counts()
            self.events.progress(shown[0], shown[1], self.plan.size, time.monotonic() - self.t0,
                                 runstate.from_head(state) if state else None)

        def on_state(doc: dict) -> None:
            state.clear()
            state.update(doc)
            if counts() != shown:   # else the next heartbeat shows it (within a second)
                report()

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
            if rank is not None:
                # a spare may run it now: where the head says it runs (its rank records)
                now_at = next((r.get("host") for r in state.get("ranks") or () if r.get("rank") == rank), None)
                host = now_at if isinstance(now_at, str) and now_at in {h.name for h in self.plan.all_hosts} else host
            stream = supervisor.EventStream(on_state, on_output, on_beat=report)
            err: OrchError | None = None
            try:
                # to the run's end (not only the followed rank's: it is pushed too); this loop is the retry
                supervisor.watch(self.pool[host], self.cluster, self.run.id, stream, to_end=True,
                                 attempt=attempt if rank is not None else None,
                                 offsets={rank: copies.offset(rank, attempt)} if rank is not None else None,
                                 connect_attempts=1)
                if host == self.plan.launch_host.name:   # a member's watch answers without the head
                    last_ok = time.monotonic()
            except OrchError as exc:
                err = exc
                if host == self.plan.launch_host.name and stream.heard is not None:
                    last_ok = max(last_ok, stream.heard)
            if stream.last_state and stream.last_state.get("state") in runstate.FINAL:
                self.view = self._slurm_word(runstate.from_head(stream.last_state))  # gather reads it
                return RunEnd.of(self.view)
            view = self.status(connect_attempts=1)
            if view.final:
                return RunEnd.of(view)
            if self.plan.launch_host.name not in view.unreachable and view.state != "unknown":
                last_ok = time.monotonic()
            if time.monotonic() - last_ok > window:
                return self._unanswered(view, err, time.monotonic() - last_ok)
            time.sleep(1.0)

    def _unanswered(self, view: RunView, err: OrchError | None, silent: float) -> RunEnd:
        """The launch host silent past the supervisors' own wait: the run is lost (its head, if it
        lives, has lost the others; they have stopped their ranks). Said as seen, with what the
        hosts that did answer recorded of their ranks."""

        head = self.plan.launch_host.name
        why = view.unreachable.get(head) or (str(err) if err else view.message)
        by_state: dict[str, list[int]] = {}
        for r in view.ranks:
            if r["host"] != head:
                by_state.setdefault(r["state"], []).append(r["rank"])
        seen = "; ".join(f"{rank_ranges(rs)} {st}" for st, rs in by_state.items())
        alive = by_state.get("running")
        view.state = "lost"
        view.message = (f"nothing heard from the launch host {head} for {silent:.0f}s, and it did not answer "
                        f"one more try ({why}). "
                        + (f"The other hosts recorded: {seen}. " if seen else "")
                        + (f"Still running: {rank_ranges(alive)}; run `orch down --run {self.run.id}`"
                           if alive else f"Once {head} is reachable, `orch down --run {self.run.id}` stops "
                           "what may be left on it"))
        self.view = view
        return RunEnd.of(view)

    # ---- the cluster's word
    def status(self, stopped: Stopped | None = None, connect_attempts: int | None = None,
               ended: bool = False) -> RunView:
        """Every host's supervisor state, merged (one round trip per host). After stop(), pass
        what it returned: the swept hosts' states are taken from it, only the others (lost ones)
        are asked now. `connect_attempts`: per host (Transport.run), for a caller that retries.
        `ended` (the run is recorded ended here: `orch status`): the launch host first; an ended
        run's head names the hosts whose supervisor said, as it ended, that nothing of the run was
        left there (`left_nothing`): only the others are asked (their orphans), often none; the
        view says when nothing is left anywhere (`nothing_left`)."""
        docs = stopped.docs if stopped else {}
        unreachable = {n: why.splitlines()[0] for n, why in stopped.failed.items()} if stopped else {}
        hosts = [h for h in self.plan.all_hosts if h.name not in docs and h.name not in unreachable]

        def ask(hosts):
            return self._fan(lambda h: supervisor.parse_json_line(
                self.pool[h].run(supervisor.status_script(self.cluster, self.run.id),
                                 connect_attempts=connect_attempts).check("reading status").out), hosts)

        res = {}
        head = self.plan.launch_host
        if ended and head in hosts:
            res = dict(ask([head]))
            doc = res[head.name].value if res[head.name].ok else None
            if doc and doc.get("role") != "member" and doc.get("state") in runstate.FINAL:
                said = set(doc.get("left_nothing") or ())
                hosts = [h for h in hosts if h.name not in said]
            hosts = [h for h in hosts if h.name != head.name]
        if hosts:
            res.update(ask(hosts))
        docs = {**docs, **{n: o.value for n, o in res.items() if o.ok}}
        docs = {h.name: docs[h.name] for h in self.plan.all_hosts if h.name in docs}
        unreachable = {**unreachable, **{n: str(o.error).splitlines()[0] for n, o in res.items() if not o.ok}}
        self.view = runstate.merge(self.plan.launch_host.name, docs, unreachable,
                                   [r.to_dict() | {"device": r.device_id} for r in self.plan.ranks], self.run.id,
                                   [h.name for h in self.plan.all_hosts] if ended else ())
        return self._slurm_word(self.view)

    def _slurm_word(self, view: RunView) -> RunView:
        """A run in a Slurm job: the job's state beside the run's, and Slurm's word on how it
        ended when it ended the run itself (time limit, node failure)."""
        job = self.run.data.get("slurm")
        if job and self.cluster.slurm is not None:
            from . import slurm  # lazy: only a Slurm inventory's runs

            info = slurm.job_view(slurm.Client(self.cluster, self.pool.__getitem__), job["job_id"])
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
        from . import runlogs as logs  # lazy: `orch status` and `down` of a recorded run gather no logs unless the run ended

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
            from . import collect  # lazy: only a job with job.collect

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
        return self.run.log_tail(rank, self.run.attempt if self.view is None else max(1, self.view.attempt), lines)


def said(t: Transport, path: str, timeout: float, limit: int = 2000) -> str:
    """A log's last lines on a host, for an error message: what it says, that it is empty, or that
    it could not be read (and why)."""
    try:
        got = t.run(["tail", "-c", str(limit), path], timeout=timeout)
    except OrchError as exc:
        return f"could not be read ({exc})"
    if not got.ok:
        return f"could not be read ({(got.err or got.out).strip()[-300:] or f'tail exited {got.exit_code}'})"
    text = got.out.strip()
    return "says:\n  " + "\n  ".join(text.splitlines()[-12:]) if text else "is empty"


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


__all__ = ["Events", "LaunchError", "Lifecycle", "RunEnd", "record", "run_dir", "stop_run"]
