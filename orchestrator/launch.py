"""The run lifecycle shared by every launcher: distribute -> start -> follow -> stop -> gather.

Launchers differ only in which processes they start and where rank logs live
(`Launcher` subclasses below); everything else is one code path. Every process
orch starts carries ORCH_RUN_ID=<run id> in its environment, and so do all of
its children (mpirun forwards it to the ranks with -x): stopping a run means
signalling exactly the processes whose environment holds that value, on every
host — never a `pkill -f` pattern that could hit an unrelated process.

Nothing here prints: progress goes to an `Events` object the CLI provides.
"""

from __future__ import annotations

import fcntl
import os
import posixpath
import re
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping

from . import render
from .errors import OrchError
from .fanout import fan_out
from .plan import RankPlan
from .runs import Run, mask_text
from .spec import Cluster
from .sync import manifest, sync_host
from .transport import Pool, SpawnSpec, Transport

RUN_VAR = "ORCH_RUN_ID"
RC_VAR = "ORCH_RC_DIR"
POLL_INTERVAL = 0.5
STOP_GRACE = 5.0
LOST_AFTER = 2           # consecutive failed polls before a host is declared lost
POLL_TIMEOUT_MIN = 5.0   # seconds; a poll is a tiny script, see poll_timeout()


def poll_timeout(ssh) -> float:
    """How long one poll may take. A poll reads a few small files, so a host that needs longer
    is in trouble (not busy with the job): min(command_timeout, max(5 s, 2 x connect_timeout)).
    With LOST_AFTER failed polls, a vanished host is declared lost within about
    poll_timeout + connect_timeout x retries."""
    return min(ssh.command_timeout, max(POLL_TIMEOUT_MIN, 2 * ssh.connect_timeout))


def rank_ranges(ranks) -> str:
    """[4, 5, 6, 9] -> 'ranks 4-6,9'; [3] -> 'rank 3'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts: list[str] = []
    start = prev = None
    for r in ranks + [None]:
        if r is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return "ranks " + ",".join(parts)

# --------------------------------------------------------------------------- remote paths (pure)


def run_dir(cluster: Cluster, run_id: str) -> str:
    """Where a run keeps its exit-code files and launcher logs on each host."""
    return posixpath.join(cluster.job.workdir, ".orch", run_id)


_RANK_RC = re.compile(r"^rank\.([0-9]+)\.rc$")
_RANK_LOG = re.compile(r"/rank\.0*([0-9]+)/stdout$")
_WORKER_LOG = re.compile(r"/worker_0*([0-9]+)\.log$")


def log_glob(cluster: Cluster) -> str:
    """The shell glob matching every rank log of the job's launcher on a host."""
    base = render.log_dir_path(cluster)
    if cluster.job.launcher == "msrun":
        return shlex.quote(base) + "/worker_*.log"
    return shlex.quote(base) + "/1/rank.*/stdout"


def rank_of_log(path: str) -> int | None:
    """mpirun writes rank.N (zero-padded by some versions), msrun worker_N.log: both map to N."""
    m = _RANK_LOG.search(path) or _WORKER_LOG.search(path)
    return int(m.group(1)) if m else None


def sweep_script(run_id: str, signal_name: str | None, grace: float = STOP_GRACE) -> str:
    """Signal every process of this run on a host (found by ORCH_RUN_ID in its environment);
    with TERM, wait up to `grace` seconds, then KILL what is left. Prints what it did."""
    needle = shlex.quote(f"{RUN_VAR}={run_id}")
    find = (f"find_pids() {{ grep -lzxF -- {needle} /proc/[0-9]*/environ 2>/dev/null | "
            "cut -d/ -f3 | grep -vx \"$$\"; }\n")
    if signal_name is None:
        return find + "find_pids | tr '\\n' ' '\n"
    steps = int(grace / 0.2)
    return (find + "pids=$(find_pids)\n[ -z \"$pids\" ] && { echo none; exit 0; }\n"
            f"kill -{signal_name} $pids 2>/dev/null\n"
            f"i=0\nwhile [ $i -lt {steps} ]; do sleep 0.2; pids=$(find_pids); [ -z \"$pids\" ] && break; i=$((i+1)); done\n"
            "if [ -n \"$pids\" ]; then kill -KILL $pids 2>/dev/null; echo killed $pids; else echo stopped; fi\n")


def poll_script(cluster: Cluster, run_id: str, pids: list[int], with_logs: bool) -> str:
    """One round trip: the exit codes written so far, which of our process groups are alive,
    and (optionally) the size of every rank log on the host."""
    rd = shlex.quote(run_dir(cluster, run_id))
    # Liveness first, exit codes second: a process writes its exit code before it exits, so one
    # seen dead here has its code in the listing below (the other order races with a rank ending).
    lines = ["alive=$(ps -e -o sid=,stat= 2>/dev/null | awk '$2 !~ /^Z/ {print $1}')"]
    for pid in pids:
        lines.append(f"echo \"$alive\" | grep -qx {int(pid)} && echo alive {int(pid)}")
    lines.append(f"for f in {rd}/*.rc; do [ -f \"$f\" ] && echo \"rc ${{f##*/}} $(cat \"$f\") "
                 f"$(stat -c %.9Y \"$f\" 2>/dev/null || stat -c %Y \"$f\" 2>/dev/null)\"; done")
    if with_logs:
        lines.append(f"for f in {log_glob(cluster)}; do [ -f \"$f\" ] && echo \"log $(stat -c %s \"$f\") $f\"; done")
    lines.append("exit 0")
    return "\n".join(lines)


@dataclass
class HostPoll:
    rcs: dict[str, int] = field(default_factory=dict)   # rc file name -> exit code
    alive: set[int] = field(default_factory=set)
    logs: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (size, path)
    rc_times: dict[str, float] = field(default_factory=dict)  # rc file name -> when it was written (host clock)


_INT = re.compile(r"-?[0-9]{1,18}", re.ASCII)


def _int(text: str) -> int | None:
    """An ASCII integer, or None (str.isdigit() also accepts '²', which int() refuses)."""
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


def parse_poll(text: str) -> HostPoll:
    """The poll script's output -> HostPoll. Lines it does not understand are ignored."""
    p = HostPoll()
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "rc":
            name, _, rest = rest.partition(" ")
            code, _, when = rest.strip().partition(" ")
            if _int(code) is not None:
                p.rcs[name] = _int(code)
                try:
                    p.rc_times[name] = float(when)
                except ValueError:
                    pass
        elif kind == "alive" and _int(rest) is not None:
            p.alive.add(_int(rest))
        elif kind == "log":
            size, _, path = rest.partition(" ")
            rank = rank_of_log(path)
            if rank is not None and _int(size) is not None:
                p.logs[rank] = (_int(size), path)
    return p


def parse_status(text: str) -> tuple[dict[int, int], dict[int, int], bool]:
    """status_script's output -> ({rank: exit code}, {rank: pid}, whether any process of the run
    lives there). Lines it does not understand are ignored."""
    rcs: dict[int, int] = {}
    pids: dict[int, int] = {}
    live = False
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["rc"] and len(parts) == 3:
            m = _RANK_RC.match(parts[1])
            if m and _int(parts[2]) is not None:
                rcs[int(m.group(1))] = _int(parts[2])
        elif parts[:1] == ["pid"] and len(parts) == 3 and _int(parts[1]) is not None:
            live = True
            rank = _int(parts[2])
            if rank is not None and rank >= 0:
                pids[rank] = max(pids.get(rank, 0), _int(parts[1]))
    return rcs, pids, live


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code (killed or lost)"
    if code > 128:
        sig = code - 128
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    return f"exit code {code}"


# --------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class Proc:
    """A top-level process orch started: mpirun, one msrun per host, or one rank."""

    key: str
    host: str
    pid: int
    rc_name: str          # file name in the run dir
    rank: int | None = None


class Launcher:
    """Turns a plan into processes. Subclasses say which, and nothing else."""

    def __init__(self, cluster: Cluster, plan: RankPlan, run_id: str, root: Mapping[str, bool]):
        self.cluster = cluster
        self.plan = plan
        self.run_id = run_id
        self.rd = run_dir(cluster, run_id)
        self.root = root

    def files(self, device_ips: Mapping[str, Mapping[int, str]] | None) -> dict[str, dict[str, bytes]]:
        """{host name: {path relative to workdir: bytes}} rendered files to distribute."""
        return {h.name: {} for h in self.plan.hosts}

    def specs(self) -> dict[str, list[tuple[str, int | None, SpawnSpec]]]:
        """{host: [(key, rank, spec)]}: what to start on each host."""
        raise NotImplementedError

    def cleanup_script(self) -> str:
        """Run on every host before start: a fresh run dir, no stale rank logs from earlier runs."""
        logdir = shlex.quote(render.log_dir_path(self.cluster))
        return (f"mkdir -p {shlex.quote(self.rd)} {logdir} && "
                f"rm -rf {logdir}/1/rank.* {logdir}/worker_*.log {logdir}/scheduler.log")

    def _spec(self, command, log: str, env: Mapping[str, str], rc_name: str) -> SpawnSpec:
        return SpawnSpec(command, log, dict(env), self.cluster.job.workdir,
                         posixpath.join(self.rd, rc_name), (RUN_VAR, self.run_id))


class MpirunLauncher(Launcher):
    def files(self, device_ips):
        out = super().files(device_ips)
        out[self.plan.launch_host.name][render.HOSTFILE] = render.hostfile(self.plan).encode()
        return out

    def specs(self):
        # Each rank runs under a tiny sh wrapper that records its exit code on its own host.
        # Its own stderr is /dev/null, the rank's is the rank's: a shell's note about a child killed
        # by a signal ("Killed", "Terminated") is the shell's, and must not land in the rank's log.
        # (The rank's stderr is set inside a subshell: dash applies `cmd 2>&3` in the parent too.)
        wrapper = ("exec 3>&2 2>/dev/null; ( exec 2>&3 3>&-; exec \"$@\" ); c=$?; "
                   "f=\"$ORCH_RC_DIR/rank.$OMPI_COMM_WORLD_RANK.rc\"; "
                   "echo $c > \"$f.tmp\" && mv -f \"$f.tmp\" \"$f\"; exit $c")
        job = replace(self.cluster.job, command=("sh", "-c", wrapper, "orch-rank", *self.cluster.job.command))
        cluster = replace(self.cluster, job=job)
        head = self.plan.launch_host
        argv = render.mpirun_argv(cluster, self.plan, hostfile_path=render.hostfile_path(cluster),
                                  root=self.root.get(head.name, False))
        env = {**render.mpirun_env(cluster, self.plan), **_host_path_env(cluster, head.name)}
        log = posixpath.join(self.rd, "mpirun.log")
        return {head.name: [("mpirun", None, self._spec(argv, log, env, "mpirun.rc"))]}


class RanktableLauncher(Launcher):
    def files(self, device_ips):
        out = super().files(device_ips)
        if self.cluster.job.platform == "ascend":
            table = render.rank_table(self.cluster, self.plan, device_ips or {}).encode()
            for h in self.plan.hosts:
                out[h.name][render.RANK_TABLE] = table
        return out

    def specs(self):
        out: dict[str, list] = {h.name: [] for h in self.plan.hosts}
        table = render.rank_table_path(self.cluster)
        head = self.plan.launch_host
        for r in self.plan.ranks:
            env = render.rank_env(self.cluster, self.plan, r, table)
            if self.cluster.job.platform != "ascend":  # no rank table off Ascend
                env.pop("RANK_TABLE_FILE", None)
            # torch/gloo-style names too, so one script runs under any launcher
            env.setdefault("MASTER_ADDR", head.address)
            env.setdefault("MASTER_PORT", str(self.cluster.job.master_port))
            env.update({"RANK": str(r.rank), "WORLD_SIZE": str(self.plan.size), "LOCAL_RANK": str(r.local_rank)})
            log = render.rank_log_path(self.cluster, r.rank)
            envlog = posixpath.join(posixpath.dirname(log), "env.log")
            # seed 001 saves each rank's environment beside its log
            # then exec: no shell of orch's waits on the rank (see Transport.spawn_many)
            cmd = ["sh", "-c", '(umask 077; env > "$1"); shift; exec "$@"', "orch-rank", envlog,
                   *self.cluster.job.command]
            out[r.host].append((f"rank.{r.rank}", r.rank, self._spec(cmd, log, env, f"rank.{r.rank}.rc")))
        return out


class MsrunLauncher(Launcher):
    # msrun itself exits with one code per host (1 whichever worker failed, after killing its
    # siblings), and it starts nothing but python. So each worker starts as
    # `python -c <exec sh> <interpreter> script args`: that python at once becomes a sh wrapper
    # which runs the script and records the rank's own exit code on its host, as mpirun's ranks
    # do. msrun starts its scheduler with the same command (MS_ROLE=MS_SCHED): that one runs as is.
    RANK_WRAPPER = ('if [ "$MS_ROLE" = MS_SCHED ] || [ -z "$RANK_ID" ]; then exec "$@"; fi; '
                    '"$@"; c=$?; f="$ORCH_RC_DIR/rank.$RANK_ID.rc"; '
                    'echo $c > "$f.tmp" && mv -f "$f.tmp" "$f"; exit $c')

    def task(self) -> list[str]:
        """What msrun runs for every worker (and its scheduler), in place of `script args`."""
        command = list(self.cluster.job.command)
        script = render.msrun_script(command)
        interp = command[0] if len(command) > len(script) else "python"  # msrun's own default
        exec_sh = ("import os,sys; os.execv('/bin/sh', ['sh', '-c', %r, 'orch-rank'] + sys.argv[1:])"
                   % self.RANK_WRAPPER)
        # msrun runs `python`/`python3` given as the script as is (anything else: `python X`)
        starter = "python3" if posixpath.basename(interp).startswith("python3") else "python"
        return [starter, "-c", exec_sh, interp, *script]

    def specs(self):
        out = {}
        n = len(render.msrun_script(self.cluster.job.command))
        for h in self.plan.hosts:
            argv = render.msrun_argv(self.cluster, self.plan, h.name)
            argv = argv[:len(argv) - n] + self.task()
            env = render.msrun_env(self.cluster, self.plan, h.name)
            log = posixpath.join(self.rd, "msrun.log")
            out[h.name] = [(f"msrun.{h.name}", None, self._spec(argv, log, env, f"msrun.{h.name}.rc"))]
        return out


LAUNCHERS = {"mpirun": MpirunLauncher, "ranktable": RanktableLauncher, "msrun": MsrunLauncher}


def _host_path_env(cluster: Cluster, host: str) -> dict[str, str]:
    """job.env / host env PATH applies to the launcher command itself (to find mpirun/msrun)."""
    env = render.host_env(cluster, cluster.host(host))
    return {k: env[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in env}


# --------------------------------------------------------------------------- the lifecycle


class Events:
    """What the lifecycle reports. The CLI subclasses this to print; the default is silent."""

    def step(self, message: str) -> None: ...
    def progress(self, running: int, exited: int, total: int, elapsed: float) -> None: ...
    def output(self, rank: int, data: bytes) -> None: ...
    def warning(self, message: str) -> None: ...


@dataclass
class Outcome:
    state: str                       # succeeded | failed | interrupted | stopped | timeout | detached
    exit_codes: dict[int, int | None]
    message: str = ""
    first_failure: dict | None = None


class Lifecycle:
    def __init__(self, cluster: Cluster, plan: RankPlan, run: Run, pool: Pool, events: Events | None = None,
                 follow_rank: int | None = 0):
        job = cluster.job
        env = {**job.env, RUN_VAR: run.id, RC_VAR: run_dir(cluster, run.id)}
        self.cluster = replace(cluster, job=replace(job, env=env))
        self.plan = plan
        self.run = run
        self.pool = pool
        self.events = events or Events()
        self.follow_rank = follow_rank
        self.procs: list[Proc] = []
        self.exit_codes: dict[int, int | None] = {}
        self.first_failure: dict | None = None
        self.lost: set[str] = set()
        self.suspect: dict[str, int] = {}
        self.offsets: dict[int, int] = {}
        self.stopped = threading.Event()

    # ---- helpers
    def _fan(self, fn: Callable, hosts=None, timeout: float | None = None):
        hosts = self.plan.hosts if hosts is None else hosts
        return fan_out(hosts, fn, limit=self.cluster.ssh.fanout, timeout=timeout)

    def _t(self, host) -> Transport:
        return self.pool[host]

    def _save(self, **updates) -> None:
        self.run.data.update(updates)
        self.run.data["procs"] = [p.__dict__ for p in self.procs]
        self.run.data["exit_codes"] = {str(k): v for k, v in sorted(self.exit_codes.items())}
        self.run.data["first_failure"] = self.first_failure
        self.run.save()

    # ---- steps
    def distribute(self, device_ips) -> None:
        launcher = LAUNCHERS[self.cluster.job.launcher](self.cluster, self.plan, self.run.id, {})
        entries = manifest(self.cluster.base_dir, self.cluster.job.sync, str(self.cluster.path))
        files = launcher.files(device_ips)
        for name, data in {n: d for host_files in files.values() for n, d in host_files.items()}.items():
            self.run.write_file(name, data.decode())
        self.events.step(f"syncing {len(entries)} file(s) to {len(self.plan.hosts)} host(s)")
        results = self._fan(lambda h: sync_host(self._t(h), self.cluster.job.workdir, entries, files.get(h.name)))
        failed = [o for o in results.values() if not o.ok]
        if failed:
            raise LaunchError("distribution failed; nothing was started:\n" + "\n".join(
                f"  {o.error}" for o in failed))
        copied = sum(len(o.value.copied) for o in results.values())
        self.events.step(f"synced: {copied} file copies, "
                         f"{sum(len(o.value.unchanged) for o in results.values())} already up to date")

    def start(self) -> None:
        is_root = self._fan(lambda h: self._t(h).run(["id", "-u"]).out.strip() == "0")
        roots = {n: bool(o.value) for n, o in is_root.items()}
        bad = [o for o in is_root.values() if not o.ok]
        if bad:
            raise LaunchError("cannot reach every host; nothing was started:\n" + "\n".join(f"  {o.error}" for o in bad))
        launcher = LAUNCHERS[self.cluster.job.launcher](self.cluster, self.plan, self.run.id, roots)
        specs = launcher.specs()
        self.run.data["commands"] = {
            h: [{"key": k, "command": mask_text(self.cluster.job, dict(s.env or {}),
                                                s.command if isinstance(s.command, str) else shlex.join(s.command)),
                 "log": s.log} for k, _, s in items] for h, items in specs.items()}

        def go(h):
            t = self._t(h)
            t.run(launcher.cleanup_script()).check("preparing the run directory")
            items = specs.get(h.name, [])
            spawned = t.spawn_many([s for _, _, s in items]) if items else []
            return [Proc(k, h.name, sp.pid, posixpath.basename(s.rc_file), rank)
                    for (k, rank, s), sp in zip(items, spawned)]

        results = self._fan(go)
        for o in results.values():
            if o.ok:
                self.procs.extend(o.value)
        failed = [o for o in results.values() if not o.ok]
        self._save(state="running", launched=time.time())
        if failed:
            self.stop()
            raise LaunchError("could not start on every host (what started was stopped):\n" + "\n".join(
                f"  {o.error}" for o in failed))
        self.events.step(f"started {len(self.procs)} process(es) for {self.plan.size} rank(s); run {self.run.id}")

    def poll(self) -> dict[str, HostPoll | OrchError]:
        by_host: dict[str, list[int]] = {}
        for p in self.procs:
            by_host.setdefault(p.host, []).append(p.pid)
        hosts = [h for h in self.plan.hosts if h.name not in self.lost]

        def one(h):
            script = poll_script(self.cluster, self.run.id, by_host.get(h.name, []), with_logs=False)
            return parse_poll(self._t(h).run(script, timeout=poll_timeout(self.cluster.ssh)).check("polling").out)

        return {n: (o.value if o.ok else o.error) for n, o in self._fan(one, hosts).items()}

    def follow(self, detach: bool = False) -> Outcome:
        if detach:
            return Outcome("detached", {})
        t0 = time.monotonic()
        deadline = t0 + self.cluster.job.timeout if self.cluster.job.timeout else None
        total = self.plan.size
        while True:
            polls = self.poll()
            stopper = self.run.stop_requested()
            if stopper:  # asked before anything was signalled, so seen before what it did
                return Outcome("stopped", self.exit_codes, f"stopped by {stopper}")
            newly_lost: dict[str, OrchError] = {}
            for name, p in polls.items():
                if isinstance(p, OrchError):
                    # a host that fails LOST_AFTER polls in a row is lost (one failure may be a blip)
                    self.suspect[name] = self.suspect.get(name, 0) + 1
                    if self.suspect[name] >= LOST_AFTER:
                        newly_lost[name] = p
                    continue
                self.suspect.pop(name, None)
            self.absorb(polls)
            if newly_lost:
                self.lost.update(newly_lost)
                return Outcome("failed", self.exit_codes, self._lost_message(newly_lost))
            if self.follow_rank is not None:
                self._stream(self.follow_rank)
            done, alive = self._finished()
            self.events.progress(alive, len([c for c in self.exit_codes.values() if c is not None]), total,
                                 time.monotonic() - t0)
            if self.first_failure and self.cluster.job.on_failure == "stop":
                ff = self.first_failure
                return Outcome("failed", self.exit_codes,
                               f"rank {ff['rank']} on {ff['host']} (device {ff['device']}) failed: {ff['how']}",
                               ff)
            if done:
                break
            if deadline and time.monotonic() > deadline:
                return Outcome("timeout", self.exit_codes,
                               f"the job did not finish within job.timeout = {self.cluster.job.timeout:g}s")
            time.sleep(POLL_INTERVAL)
        if self.follow_rank is not None:
            self._stream(self.follow_rank)
        bad = {r: c for r, c in self.exit_codes.items() if c != 0}
        top_bad = [p for p in self.procs if self.run.data.get("top_rc", {}).get(p.key) not in (0, None)]
        if bad or top_bad or len(self.exit_codes) < total and self.cluster.job.launcher != "msrun":
            msg = self.first_failure and (f"rank {self.first_failure['rank']} on {self.first_failure['host']} "
                                          f"failed: {self.first_failure['how']}")
            if not msg and top_bad:
                p = top_bad[0]
                msg = f"{p.key} on {p.host} failed: {describe_exit(self.run.data['top_rc'][p.key])}"
            return Outcome("failed", self.exit_codes, msg or "some ranks did not report an exit code",
                           self.first_failure)
        return Outcome("succeeded", self.exit_codes, f"all {total} ranks exited 0")

    def _lost_message(self, lost: Mapping[str, OrchError]) -> str:
        lines = []
        for name, err in lost.items():
            reason = err.message[len(name) + 2:] if err.message.startswith(f"{name}: ") else err.message
            ranks = rank_ranges(r.rank for r in self.plan.by_host(name))
            lines.append(f"lost contact with host {name} ({ranks}): {reason}")
        names = ", ".join(lost)
        return ("; ".join(lines) + f". The job was stopped on every other host. What runs on {names} could "
                f"not be stopped: once it is reachable again, run `orch down --run {self.run.id}`")

    def absorb(self, polls: Mapping[str, "HostPoll | OrchError"]) -> None:
        """Take in one round of polls (errors are skipped); the earliest failure among them,
        by the time its exit code was written, becomes first_failure if there is none yet."""
        candidates: list[tuple[float, int, int | None, str]] = []
        for name, p in polls.items():
            if not isinstance(p, OrchError):
                candidates += self._absorb(name, p)
        if candidates and self.first_failure is None:
            _, rank, code, how = min(candidates, key=lambda c: (c[0], c[1]))
            r = self.plan.ranks[rank]
            self.first_failure = {"rank": rank, "host": r.host, "device": r.device_id, "exit_code": code,
                                  "how": how}

    def _absorb(self, host: str, p: HostPoll) -> list[tuple[float, int, int | None, str]]:
        """One host's poll -> exit codes recorded; returns the new failures as (when, rank, code, how)."""
        now = time.time()
        failed: list[tuple[float, int, int | None, str]] = []
        top = self.run.data.setdefault("top_rc", {})
        for name, code in p.rcs.items():
            m = _RANK_RC.match(name)
            if m:
                rank = int(m.group(1))
                if rank < self.plan.size and self.exit_codes.get(rank) is None:
                    self.exit_codes[rank] = code
                    if code != 0:
                        failed.append((p.rc_times.get(name, now), rank, code, describe_exit(code)))
        for proc in self.procs:
            if proc.host != host:
                continue
            if proc.rc_name in p.rcs:
                top[proc.key] = p.rcs[proc.rc_name]
            elif proc.pid not in p.alive and proc.key not in top:
                top[proc.key] = None  # gone without an exit code: killed
                if proc.rank is not None and self.exit_codes.get(proc.rank) is None:
                    self.exit_codes[proc.rank] = None
                    failed.append((now, proc.rank, None, describe_exit(None)))
        if self.cluster.job.launcher == "msrun":  # each rank wrote its own code (MsrunLauncher)
            for proc in self.procs:
                if proc.host == host and top.get(proc.key) is not None:
                    for r in self.plan.by_host(host):
                        # no code of its own: msrun failed and killed it (or never started it)
                        self.exit_codes.setdefault(r.rank, 0 if top[proc.key] == 0 else None)
                    if top[proc.key] != 0:
                        r = self.plan.by_host(host)[0]
                        failed.append((p.rc_times.get(proc.rc_name, now), r.rank, top[proc.key],
                                       f"msrun on {host}: {describe_exit(top[proc.key])}"))
        return failed

    def _finished(self) -> tuple[bool, int]:
        top = self.run.data.get("top_rc", {})
        alive = sum(1 for p in self.procs if p.key not in top)
        return alive == 0, alive

    def _stream(self, rank: int) -> None:
        """Fetch the rank's new bytes and pass them on, a block at a time (a log may be huge).
        self.offsets[rank] is how far it was passed on: bytes another command gathered count too."""
        if rank >= self.plan.size:
            return
        r = self.plan.ranks[rank]
        if r.host in self.lost:
            return
        try:
            self._fetch(rank)
        except OrchError:
            return
        local = self.run.local_log(rank)
        size = local.stat().st_size if local.exists() else 0
        pos = self.offsets.get(rank, 0)
        if size < pos:  # the remote log was rewritten and fetched again from its start
            pos = 0
        for block in read_blocks(local, pos, size):
            self.events.output(rank, block)
            pos += len(block)
        self.offsets[rank] = pos

    def _fetch(self, rank: int, path: str | None = None, size: int | None = None) -> int:
        """Bring the local copy of a rank's log up to date (only the new bytes move).

        Under an exclusive lock on the rank's local directory: `orch up`, `orch logs -f` and
        `orch down` may gather the same run at once, and two appends of the same new bytes
        would duplicate them."""
        local = self.run.local_log(rank)
        local.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(local.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._fetch_locked(rank, path, size)
        finally:
            os.close(fd)

    def _fetch_locked(self, rank: int, path: str | None, size: int | None) -> int:
        r = self.plan.ranks[rank]
        local = self.run.local_log(rank)
        have = local.stat().st_size if local.exists() else 0
        if path is None:
            path = render.rank_log_path(self.cluster, rank) if self.cluster.job.launcher != "msrun" else \
                posixpath.join(render.log_dir_path(self.cluster), f"worker_{rank}.log")
            res = self._t(r.host).run(["sh", "-c", 'stat -c %s "$1" 2>/dev/null || echo -1', "-", path])
            size = _int(res.out) if res.ok else None
            if size is None or size < 0:
                return 0
        if size is not None and size < have:  # rewritten remotely: start again
            have = 0
        if size is not None and size == have:
            return 0
        return self._t(r.host).get(path, local, offset=have)

    def stop(self, hosts=None) -> dict[str, str]:
        """TERM every process of this run on every (reachable) host, KILL after a grace period."""
        if self.stopped.is_set() and hosts is None:
            return {}
        hosts = [h for h in (hosts or self.plan.hosts) if h.name not in self.lost]
        res = self._fan(lambda h: self._t(h).run(sweep_script(self.run.id, "TERM"),
                                                 timeout=STOP_GRACE + self.cluster.ssh.command_timeout).out.strip(),
                        hosts)
        self.stopped.set()
        return {n: (o.value if o.ok else f"could not stop: {o.error}") for n, o in res.items()}

    def gather(self) -> dict[str, str]:
        """Fetch every rank's new log bytes from every reachable host. Never raises."""
        def one(h):
            script = f"for f in {log_glob(self.cluster)}; do [ -f \"$f\" ] && echo \"log $(stat -c %s \"$f\") $f\"; done; exit 0"
            found = parse_poll(self._t(h).run(script).check("listing logs").out).logs
            mine = {r.rank for r in self.plan.by_host(h.name)}
            n = 0
            for rank, (size, path) in sorted(found.items()):
                if rank in mine:
                    n += self._fetch(rank, path, size)
            return n

        hosts = [h for h in self.plan.hosts if h.name not in self.lost]
        res = self._fan(one, hosts)
        self._fetch_launcher_logs()  # mpirun's own log helps when it failed before any rank ran
        return {n: ("ok" if o.ok else str(o.error)) for n, o in res.items()}

    def _fetch_launcher_logs(self) -> None:
        for p in self.procs:
            if p.rank is not None or p.host in self.lost:
                continue
            name = "msrun.log" if p.key.startswith("msrun.") else "mpirun.log"  # the only non-rank procs
            try:
                self._t(p.host).get(posixpath.join(run_dir(self.cluster, self.run.id), name),
                                    self.run.dir / "launcher" / f"{p.key}.log")
            except OrchError:
                pass

    def finish(self, outcome: "Outcome") -> None:
        """Record the outcome in run.json (atomically)."""
        codes = dict(self.exit_codes)
        self.exit_codes = {r.rank: codes.get(r.rank) for r in self.plan.ranks} if outcome.state != "detached" \
            else codes
        self._save(state="running" if outcome.state == "detached" else outcome.state,
                   ended=None if outcome.state == "detached" else time.time(), message=outcome.message,
                   lost=sorted(self.lost))

    def log_tail(self, rank: int, lines: int = 20) -> str:
        local = self.run.local_log(rank)
        if not local.exists():
            return ""
        with open(local, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 65536))
            data = fh.read()
        return b"\n".join(data.splitlines()[-lines:]).decode("utf-8", "replace")


class LaunchError(OrchError):
    exit_code = 1


# --------------------------------------------------------------------------- hccn.conf


def read_device_ips(plan: RankPlan, pool: Pool) -> dict[str, dict[int, str]]:
    """Device IPs for the rank table: the inventory's `device_ips`, else each host's
    /etc/hccn.conf (read only from hosts that need it, over the open connections)."""
    from .errors import PlanError
    from .plan import HCCN_CONF, device_ips_for, parse_hccn_conf

    need = [h for h in plan.hosts if any(d not in h.device_ips for d in h.devices)]
    outcomes = fan_out(need, lambda h: parse_hccn_conf(pool[h].run(["cat", HCCN_CONF]).check(
        f"reading {HCCN_CONF}").out), limit=pool.cluster.ssh.fanout)
    failed = [o.error for o in outcomes.values() if not o.ok]
    if failed:
        raise PlanError(f"could not read {HCCN_CONF} on {len(failed)} host(s):\n"
                        + "\n".join(f"  - {str(e).splitlines()[0]}" for e in failed[:20]),
                        hint="run `orch check` for the connection problems, or give device_ips in the inventory")
    return device_ips_for(plan, {n: o.value for n, o in outcomes.items()})


# --------------------------------------------------------------------------- a recorded run


def plan_from_run(run: Run) -> RankPlan:
    from .plan import Rank

    hosts = {h.name: h for h in run.hosts()}
    doc = run.data["plan"]
    return RankPlan(ranks=tuple(Rank(**r) for r in doc["ranks"]),
                    hosts=tuple(hosts[h["name"]] for h in doc["hosts"]),
                    launcher=doc["launcher"], platform=doc["platform"])


def lifecycle_for(run: Run, pool: Pool) -> Lifecycle:
    lc = Lifecycle(run.cluster(), plan_from_run(run), run, pool, follow_rank=None)
    lc.procs = [Proc(**p) for p in run.data.get("procs", [])]
    lc.exit_codes = {int(k): v for k, v in run.data.get("exit_codes", {}).items()}
    lc.lost = set(run.data.get("lost") or ())
    return lc


def status_script(cluster: Cluster, run_id: str) -> str:
    """Exit codes so far, and each live process of the run with the rank it serves."""
    rd = shlex.quote(run_dir(cluster, run_id))
    needle = shlex.quote(f"{RUN_VAR}={run_id}")
    return (f"for f in {rd}/*.rc; do [ -f \"$f\" ] && echo \"rc ${{f##*/}} $(cat \"$f\")\"; done\n"
            f"for f in $(grep -lzxF -- {needle} /proc/[0-9]*/environ 2>/dev/null); do\n"
            "  p=${f#/proc/}; p=${p%/environ}\n"
            "  r=$(tr '\\0' '\\n' < \"$f\" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p; s/^RANK_ID=//p' | head -n 1)\n"
            "  echo \"pid $p ${r:--}\"\n"
            "done\nexit 0")


def run_status(run: Run) -> tuple[list[dict], dict[str, str]]:
    """Per rank: host, device, pid, state (running / exited / killed / gone), exit code."""
    with Pool(run.cluster()) as pool:
        lc = lifecycle_for(run, pool)
        res = lc._fan(lambda h: pool[h].run(status_script(lc.cluster, run.id)).check("reading status").out)
    rcs: dict[int, int] = {}
    pids: dict[int, int] = {}
    live_hosts: set[str] = set()
    unreachable = {}
    for name, o in res.items():
        if not o.ok:
            unreachable[name] = str(o.error).splitlines()[0]
            continue
        host_rcs, host_pids, live = parse_status(o.value)
        rcs.update(host_rcs)
        for rank, pid in host_pids.items():
            pids[rank] = max(pids.get(rank, 0), pid)
        if live:
            live_hosts.add(name)
    recorded = {int(k): v for k, v in run.data.get("exit_codes", {}).items()}
    rows = []
    for r in lc.plan.ranks:
        code = rcs.get(r.rank, recorded.get(r.rank))
        if r.host in unreachable:
            state = "unknown (host unreachable)"
        elif r.rank in pids:
            state = "running"
        elif code is not None:
            state = "exited" if code <= 128 else f"killed ({describe_exit(code)})"
        elif r.host in live_hosts and run.data.get("launcher") == "msrun":
            state = "running"
        else:
            state = "killed" if run.data.get("state") in ("interrupted", "failed", "stopped", "timeout") else "gone"
        rows.append({"rank": r.rank, "host": r.host, "device": r.device_id, "pid": pids.get(r.rank),
                     "state": state, "exit_code": code})
    return rows, unreachable


def run_down(run: Run) -> tuple[dict[str, str], dict[str, str], bool]:
    """Stop every process of the run on every host, gather its logs, record it. Idempotent.
    Returns ({host: what was done}, {host: why it could not be stopped}, whether the record
    and the logs were left to the run's controller).

    If the `orch up` that started the run still follows it, that controller is told first
    (Run.request_stop) and records the outcome and gathers the logs itself, so the two never
    write the run record at once."""
    run.request_stop("`orch down`")
    # Decided now, before anything is signalled: a controller alive at this point sees the request
    # at its next poll (or is finishing anyway) and records the outcome, even if it has exited by
    # the time the processes are stopped here.
    deferred = run.controller_alive()
    with Pool(run.cluster()) as pool:
        lc = lifecycle_for(run, pool)
        lc.lost.clear()
        result = lc.stop()
        if not deferred:
            lc.gather()
            run.reload()
            if not run.finished:
                lc.finish(Outcome("stopped", lc.exit_codes, "stopped by `orch down`"))
    done = {h: r for h, r in result.items() if not r.startswith("could not stop")}
    failed = {h: r for h, r in result.items() if r.startswith("could not stop")}
    return done, failed, deferred


def select_ranks(run: Run, rank: int | None, host: str | None) -> list[int]:
    from .errors import UsageError

    ranks = run.data["plan"]["ranks"]
    if host is not None:
        ranks = [r for r in ranks if host in (r["host"], r["address"])]
        if not ranks:
            raise UsageError(f"run {run.id} has no rank on host {host!r}")
    if rank is not None:
        ranks = [r for r in ranks if r["rank"] == rank]
        if not ranks:
            raise UsageError(f"run {run.id} has no rank {rank}" + (f" on host {host}" if host else "")
                             + f" (ranks 0..{len(run.data['plan']['ranks']) - 1})")
    return [r["rank"] for r in ranks]


READ_BLOCK = 1 << 20   # logs are read and passed on in blocks of this size, never whole
LINE_CAP = 4 << 20     # interleaved views: a longer line is broken (a newline added) to bound memory


def read_blocks(path: Path, start: int, end: int | None = None):
    """The bytes of `path` from `start` to `end` (default: its size now), READ_BLOCK at a time."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        if end is None:
            end = fh.seek(0, os.SEEK_END)
        fh.seek(start)
        pos = start
        while pos < end:
            block = fh.read(min(READ_BLOCK, end - pos))
            if not block:
                return
            pos += len(block)
            yield block


def tail_offset(path: Path, n: int) -> int:
    """Where the last `n` lines of `path` start, found by reading backwards from its end."""
    with open(path, "rb") as fh:
        end = fh.seek(0, os.SEEK_END)
        if n <= 0:
            return end
        pos, newlines = end, 0
        last_is_newline = None
        while pos > 0:
            step = min(READ_BLOCK, pos)
            fh.seek(pos - step)
            block = fh.read(step)
            if last_is_newline is None:
                last_is_newline = block.endswith(b"\n")
                if last_is_newline:  # the final newline ends the last line; it does not start one
                    block, pos = block[:-1], pos - 1
                    step -= 1
            i = len(block)
            while True:
                i = block.rfind(b"\n", 0, i)
                if i < 0:
                    break
                newlines += 1
                if newlines == n:
                    return pos - step + i + 1
            pos -= step
        return 0


def _prefixed(rank: int, data: bytes, pending: dict[int, bytes]) -> bytes:
    """Prefix each complete line with its rank; keep a partial last line for later (up to LINE_CAP)."""
    data = pending.pop(rank, b"") + data
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith((b"\n", b"\r")):
        if len(lines[-1]) < LINE_CAP:
            pending[rank] = lines.pop()
        else:
            lines[-1] += b"\n"
    return b"".join(b"[rank %d] " % rank + ln for ln in lines)


def iter_logs(run: Run, ranks: list[int], *, follow: bool = False, tail: int | None = None,
              prefix: bool = False, interval: float = POLL_INTERVAL):
    """Yield log bytes, a block at a time (memory stays bounded whatever the log size). A finished
    run is served from the gathered copies without touching the hosts; a running one is gathered
    first (only new bytes move), and with `follow`, polled until every selected rank has ended."""
    offsets: dict[int, int] = {}
    pending: dict[int, bytes] = {}

    def emit_from(r: int, start: int):
        offsets[r] = start
        for block in read_blocks(run.local_log(r), start):
            offsets[r] += len(block)
            out = _prefixed(r, block, pending) if prefix else block
            if out:
                yield out

    def emit_new():
        for r in ranks:
            path = run.local_log(r)
            if path.exists() and path.stat().st_size < offsets.get(r, 0):
                offsets[r] = 0  # gathered again from the start (the remote log was rewritten)
            yield from emit_from(r, offsets.get(r, 0))

    def first_pass():
        for r in ranks:
            path = run.local_log(r)
            start = tail_offset(path, tail) if tail is not None and path.exists() else 0
            yield from emit_from(r, start)

    def flush_pending():
        if prefix:
            yield from (b"[rank %d] " % r + rest + b"\n" for r, rest in sorted(pending.items()))
            pending.clear()

    if run.finished:
        yield from first_pass()
        yield from flush_pending()
        return
    with Pool(run.cluster()) as pool:
        lc = lifecycle_for(run, pool)
        lc.gather()
        yield from first_pass()
        while follow:
            polls = lc.poll()
            lc.absorb(polls)
            lc.gather()
            yield from emit_new()
            if all(lc.exit_codes.get(r) is not None for r in ranks) or lc._finished()[0]:
                lc.gather()
                yield from emit_new()
                break
            time.sleep(interval)
    yield from flush_pending()
