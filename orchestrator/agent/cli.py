"""agent.py's commands (what orch runs on the hosts):

    agent.py start RUNDIR [--silence S]
                                   config on stdin; detaches (setsid), prints "ok PID PORT ADDRS";
                                   stdin silent S seconds (default 60) before it is told: nothing starts
    agent.py start RUNDIR --foreground --config FILE [--head-port N] [--head-addresses A,B]
                                   the same in the foreground, the config read from FILE
                                   ({node} -> $SLURMD_NODENAME) and removed: a Slurm job step
    agent.py batch GOFILE          (Slurm) starts the head's step, then the members' step,
                                   and waits for both: the batch script of the allocation
    agent.py rank -- CMD...        wraps one rank started by mpirun, msrun or torchrun
    agent.py watch RUNDIR [--rank N ...] [--offset N=BYTES ...] [--attempt K] [--to-end]
                                   streams the run's state (from the head) and the named
                                   ranks' output (from this host) to stdout
    agent.py stop RUNDIR REASON    asks the run's head to stop the run (from any host)
    agent.py status RUNDIR         this host's view of the run, one JSON document
"""

import fcntl
import os
import select
import stat
import sys
import time

from . import jsonc, protocol as proto
from .layout import (AGENT, AGENT_LOG, AGENT_VAR, CONFIG, INFO, RUN_VAR, SLURM_JOB_KEYS, SLURM_JOB_VAR,
                     START_SILENCE, STATE, attempt_dir, lock_path, orch_dir, rank_log, read_json, signal)
from .procs import pid_of_run, run_pids
from .rank import main as rank_main
from .server import HEARTBEAT, TICK, Supervisor, listen, note, open_client, read_info, write_info
from .states import RunState, run_state

now = time.time


# --------------------------------------------------------------------------- private directories

def private_dir(path):
    """Make `path` a directory only this user can enter (0700), or make sure it is one: never
    through a link, never one another user owns (a planted directory). OSError otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError("%s is not a directory (a link?): orch will not write through it" % path)
    if st.st_uid != os.getuid():
        raise OSError("%s belongs to uid %d, not to this user (%d): remove it" % (path, st.st_uid, os.getuid()))
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def lock_workdir(workdir, run_id):
    """One live run per (host, workdir): an exclusive lock on <workdir>/.orch/lock, held by the
    supervisor for the run's life. The lock file is the user's alone (0600: nobody else can open
    it, so nobody else can hold it). Returns (fd, None), or (None, the run holding it)."""
    private_dir(orch_dir(workdir))
    fd = os.open(lock_path(workdir), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise OSError("%s belongs to uid %d: remove it" % (lock_path(workdir), st.st_uid))
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "?"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, run_id.encode(), 0)
    return fd, None


# --------------------------------------------------------------------------- start

def told(silence):
    """stdin's lines, blank ones left out, to its end; none when it stays silent `silence` seconds
    (layout.START_SILENCE): whoever would tell this start more is gone, it is told nothing."""
    def late(signum, frame):
        raise TimeoutError

    before = signal.signal(signal.SIGALRM, late)
    lines = []  # type: list[str]
    try:
        while True:
            signal.alarm(max(1, int(silence)))
            line = sys.stdin.readline()
            if not line:
                return lines
            if line.strip():
                lines.append(line)
    except TimeoutError:
        return []
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def cmd_start(rundir, foreground=False, config=None, head_port=None, head_addresses=None, silence=None):
    if config:
        path = config.replace("{node}", os.environ.get("SLURMD_NODENAME", ""))
        with open(path) as fh:
            cfg = jsonc.loads(fh.read())
        os.unlink(path)  # it may hold secret env values: read once
    else:
        # the configuration's line (the head's comes once the code is synced); a member, started
        # beside its head (the controller does not wait for the head's answer), then gets a second
        # line once the head runs: its port and addresses. stdin closed (or silent: told())
        # before the configuration (the sync failed), or a member's before the second line (the
        # head did not start): nothing starts here.
        lines = told(float(silence or START_SILENCE))
        sys.stdin.close()
        cfg = jsonc.loads(lines[0]) if lines else {}
        for later in lines[1:2]:
            cfg.update(jsonc.loads(later))
        if not cfg or cfg["role"] == "member" and not cfg.get("head_port"):
            _unmake(rundir)
            print(NO_HEAD)
            return 3
    if head_port:
        cfg["head_port"] = int(head_port)
    if head_addresses:
        cfg["head_addresses"] = [a for a in head_addresses.split(",") if a]
    listeners, advertised = [], []
    try:
        private_dir(orch_dir(cfg["workdir"]))
        private_dir(rundir)
        lock_fd, holder = lock_workdir(cfg["workdir"], cfg["run_id"])
        if lock_fd is None:
            print("busy %s" % holder)
            return 3
        if cfg["role"] == "head":
            given = list(cfg.get("head_addresses") or [cfg.get("head_address") or "127.0.0.1"])
            listeners, cfg["head_port"], advertised = listen(given, bool(cfg.get("head_pinned")))
            cfg["head_addresses"] = advertised
    except OSError as exc:
        sys.stderr.write("orch: the run's supervisor cannot start: %s\n" % exc)
        return 1
    write_info(rundir, cfg)
    said = "ok %d %s %s" % (os.getpid(), cfg.get("head_port") or 0, ",".join(advertised) or "-")
    if foreground:
        sys.stdout.write(said + "\n")
        sys.stdout.flush()
        return run_agent(cfg, listeners, lock_fd, None, advertised)
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        child = os.read(r, 64).decode().strip()
        os.close(r)
        if not child:
            print("failed to start the supervisor (see %s)" % os.path.join(rundir, AGENT_LOG))
            return 1
        print("ok %s %s %s" % (child, cfg.get("head_port") or 0, ",".join(advertised) or "-"))
        return 0
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    os._exit(run_agent(cfg, listeners, lock_fd, w, advertised))


NO_HEAD = "nohead"   # a start's answer when told nothing (above): nothing started, nothing left


def _unmake(rundir):
    """What the start's boot made for a run that does not start here: its agent.py, its directory."""
    for path, remove in ((os.path.join(rundir, AGENT), os.unlink), (rundir, os.rmdir)):
        try:
            remove(path)
        except OSError:
            pass


def raise_fd_limit():
    """As many descriptors as the host allows (the soft limit up to the hard one): a head of a
    large run holds one per member and per watcher."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def run_agent(cfg, listeners, lock_fd, ready_fd, advertised=()):
    """Be the run's supervisor on this host until the run ends: stdio to RUNDIR/agent.log; our
    pid written to `ready_fd` (the detaching parent's pipe) once running. Whatever goes wrong
    in the loop stops this host's ranks and records the error (Supervisor.crashed)."""
    log = os.open(os.path.join(cfg["rundir"], AGENT_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                  0o600)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ[AGENT_VAR] = "1"
    raise_fd_limit()
    sup = None
    try:
        sup = Supervisor(cfg, listeners, lock_fd, advertised)
        if ready_fd is not None:
            os.write(ready_fd, ("%d\n" % os.getpid()).encode())
            os.close(ready_fd)
        sup.loop()
    except BaseException as exc:  # noqa: BLE001 - a crash: stop what we started, say why
        import traceback
        traceback.print_exc()
        if sup is not None:
            sup.crashed(exc)
        return 1
    sup.local.drop_secrets()
    # the head's exit status is the run's (a Slurm job step: the job ends COMPLETED only if it succeeded)
    return 0 if sup.head is None or sup.head.doc["state"] == RunState.SUCCEEDED else 1  # None: not the head


# --------------------------------------------------------------------------- Slurm

def step_argv(nodes, python, rundir, *extra, no_kill=False):
    """One Slurm job step starting this run's supervisor once on each of `nodes` (what `orch plan`
    shows and `batch` runs). `python`: its argv (a list), or one word. `no_kill`: the step goes on
    when one of its nodes fails (a run with spare nodes: its head replaces the node)."""
    python = [python] if isinstance(python, str) else list(python)
    srun = ["srun", "--overlap", "--nodes=%d" % len(nodes), "--ntasks=%d" % len(nodes), "--ntasks-per-node=1",
            "--nodelist=" + ",".join(nodes), "--kill-on-bad-exit=0"] + (["--no-kill"] if no_kill else [])
    return srun + python + [os.path.join(rundir, AGENT), "start", rundir, "--foreground", "--config",
                            os.path.join(rundir, CONFIG)] + list(extra)


def cmd_batch(gofile):
    """Slurm: the batch script's part. The go file (from orch) names the run directory and the
    nodes; start the head's supervisor as a job step, read its port and addresses, start the
    members' as a second step, wait for both. Exits with the head's status."""
    with open(gofile) as fh:
        rundir = fh.readline().strip()
        spec = jsonc.loads(fh.readline())
    os.unlink(gofile)  # once: a requeued job waits for a new go instead of repeating this run
    import subprocess   # here: Slurm's batch alone (procs.Local.start)
    head, members = spec["head"], spec["members"]
    log = open(os.path.join(rundir, "batch.log"), "ab", buffering=0)

    def step(nodes, *extra):
        return step_argv(nodes, spec.get("python", "python3"), rundir, *extra, no_kill=bool(spec.get("no_kill")))

    env = dict(os.environ)
    env[AGENT_VAR] = "1"
    env[RUN_VAR] = spec["run_id"]
    # A step's SLURM_NODELIST, SLURM_TASKS_PER_NODE... describe the step (one node); what the
    # supervisors start (mpirun above all) must see the job's, as in the batch script.
    env[SLURM_JOB_VAR] = jsonc.dumps({k: v for k, v in os.environ.items() if k in SLURM_JOB_KEYS})
    head_proc = subprocess.Popen(step([head]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                 env=env)
    line = b""
    assert head_proc.stdout is not None  # a pipe
    deadline = now() + float(spec.get("start_timeout", 120))
    while not line.endswith(b"\n") and now() < deadline and len(line) < 4096:
        ready, _, _ = select.select([head_proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(head_proc.stdout.fileno(), 256)
            if not chunk:
                break
            line += chunk
    parts = line.decode("utf-8", "replace").split()
    if parts[:1] != ["ok"] or len(parts) < 3:
        log.write(("orch batch: the head's supervisor did not start: %r\n" % line).encode())
        head_proc.kill()
        head_proc.wait()
        return 1
    member_proc = None
    if members:
        extra = ["--head-port", parts[2]]
        if len(parts) > 3 and parts[3] != "-":
            extra += ["--head-addresses", parts[3]]
        member_proc = subprocess.Popen(step(members, *extra), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       env=env)
    rc = head_proc.wait()
    if member_proc is not None:
        try:
            member_proc.wait(timeout=float(spec.get("members_grace", 60)))
        except subprocess.TimeoutExpired:
            member_proc.terminate()
            member_proc.wait()
    return rc


# --------------------------------------------------------------------------- clients of the head

def head_client(rundir, role, limit):
    """An authenticated connection to the run's head, as this host's supervisor reached it
    (loopback on the launch host). Raises OSError / ProtocolError; KeyError without agent.json."""
    info = read_info(rundir)
    if not info:
        raise KeyError(INFO)
    if info.get("role") == "head":
        addresses = ["127.0.0.1"]
    else:
        addresses = ([info["head_address"]] if info.get("head_address") else []) + \
            [a for a in info.get("head_addresses") or [] if a != info.get("head_address")]
    conn, _ = open_client(addresses, info["head_port"], info["token"], info["run_id"], role, info.get("host"), limit)
    return conn


def cmd_stop(rundir, reason):
    """Ask the head to stop the run; wait (bounded) for its final state; print it."""
    try:
        conn = head_client(rundir, "control", proto.WATCH_LINE)
    except KeyError:
        print(jsonc.dumps({"stop": "no supervisor here"}))
        return 0
    except (OSError, proto.ProtocolError) as exc:
        print(jsonc.dumps({"stop": "head unreachable: %s" % exc}))
        return 0
    conn.send(proto.stop(reason))
    deadline = now() + float(os.environ.get("ORCH_STOP_WAIT", "20"))
    last = None
    from .delta import DeltaError, Follower   # lazy: a supervisor's start does without it (server.head_modules)
    doc = Follower()
    while now() < deadline and not conn.closed:
        select.select([conn], [], [], 0.5)
        try:
            lines = conn.recv_lines()
            for line in lines:
                t, f = proto.parse(proto.TO_WATCHER, conn.message(line, proto.WATCH_LINE))
                if t in ("state", "delta"):
                    last = doc.on(t, f)
                    if run_state(last.get("state")).is_terminal:
                        print(jsonc.dumps({"stop": "done", "state": last}))
                        return 0
        except (proto.ProtocolError, DeltaError) as exc:
            print(jsonc.dumps({"stop": "sent", "state": last, "error": str(exc)}))
            return 0
    print(jsonc.dumps({"stop": "sent", "state": last}))
    return 0


def cmd_status(rundir):
    """This host's view of the run: its state document, whether its supervisor lives, the run's
    processes alive here, and which of this host's ranks are alive."""
    doc = read_json(os.path.join(rundir, STATE))
    doc = doc if isinstance(doc, dict) else {}
    run = doc.get("run") if isinstance(doc.get("run"), str) else None
    doc["agent_alive"] = bool(doc.get("agent_pid")) and pid_of_run(doc.get("agent_pid"), run)
    doc["live_pids"] = run_pids(run) if run else []
    me = doc.get("host") if doc.get("role") == "member" else doc.get("head")
    doc["alive_ranks"] = sorted(r["rank"] for r in doc.get("ranks") or []
                                if isinstance(r, dict) and r.get("host") == me and r.get("pid")
                                and pid_of_run(r["pid"], run))
    print(jsonc.dumps(doc))
    return 0


def wait_agent_exit(rundir, limit):
    """Wait (bounded) until this host's supervisor of the run has exited."""
    doc = read_json(os.path.join(rundir, STATE)) or {}
    pid, run = doc.get("agent_pid"), doc.get("run")
    deadline = now() + limit
    while pid and now() < deadline and pid_of_run(pid, run):
        time.sleep(0.05)


class Tail:
    """Output of one rank on this host, read as it grows (attempt by attempt)."""

    def __init__(self, rank, offset, attempt):
        self.rank, self.offset, self.attempt = rank, offset, attempt


def cmd_watch(rundir, ranks, offsets, first_attempt=1, to_end=False):
    """Stream to stdout, until the run ends (or every named rank has ended, unless `to_end`):
         E <json>\\n           the head's state (when the stream starts, and the last word)
         D <json>\\n           what changed in it (delta.py: apply it to the last E)
         O <rank> <attempt> <n>\\n<n bytes>   new output of a named rank on this host
         H\\n                  at least once a second (the reader's sign of life)
         X <why>\\n            the end"""
    info = read_info(rundir) or {}
    out = sys.stdout.buffer
    launcher = info.get("launcher", "mpirun")
    tails = {r: Tail(r, offsets.get(r, 0), first_attempt) for r in ranks}
    try:
        conn = head_client(rundir, "watcher", proto.WATCH_LINE)
    except (OSError, KeyError, proto.ProtocolError):
        conn = None
    state = None
    from .delta import DeltaError, Follower   # lazy: as in cmd_stop
    doc = Follower()
    last_beat = 0.0
    last_msg = now()

    def pump(attempt, final=False):
        for t in tails.values():
            if attempt and attempt != t.attempt:
                t.attempt, t.offset = attempt, 0
            path = rank_log(attempt_dir(rundir, t.attempt), t.rank, launcher)
            try:
                fh = open(path, "rb")
            except OSError:
                continue
            with fh:
                fh.seek(t.offset)
                budget = 8 << 20   # per rank and tick while the run goes on; all of it at the end
                while final or budget > 0:
                    data = fh.read(1 << 20)
                    if not data:
                        break
                    out.write(b"O %d %d %d\n" % (t.rank, t.attempt, len(data)) + data)
                    t.offset += len(data)
                    budget -= len(data)
        out.flush()

    def event(doc):
        out.write(b"E " + jsonc.dumps(doc or {}, separators=(",", ":")).encode() + b"\n")

    while True:
        if conn is not None and not conn.closed:
            select.select([conn], [], [], TICK)
            try:
                for line in conn.recv_lines():
                    t, f = proto.parse(proto.TO_WATCHER, conn.message(line, proto.WATCH_LINE))
                    last_msg = now()
                    if t == "state":
                        state = doc.on(t, f)
                        event(state)
                    elif t == "delta":
                        state = doc.on(t, f)
                        out.write(b"D " + jsonc.dumps(f["delta"], separators=(",", ":")).encode() + b"\n")
            except (proto.ProtocolError, DeltaError) as exc:
                note(info.get("host", "?"), "watch: %s" % exc)
                conn.close()
        else:
            time.sleep(TICK)
        if conn is None or conn.closed or now() - last_msg > float(os.environ.get("ORCH_LOST_AFTER", "10")):
            # the head is gone: what the cluster wrote is the last word
            doc = read_json(os.path.join(rundir, STATE))
            if isinstance(doc, dict) and doc.get("role") != "member":
                state = doc
            pump(state.get("attempt") if state else 0, final=True)
            event(state)
            out.write(b"X head\n")
            out.flush()
            return 0
        attempt = state.get("attempt") if state else 0
        pump(attempt)
        if state and run_state(state.get("state")).is_terminal:
            pump(attempt, final=True)
            wait_agent_exit(rundir, 5.0)   # the run has left nothing behind when the stream ends
            out.write(b"X end\n")
            out.flush()
            return 0
        if state and ranks and not to_end:
            mine = [r for r in state.get("ranks", []) if r["rank"] in tails]
            if mine and all(r.get("end") is not None for r in mine) and state.get("state") != RunState.STARTING:
                pump(attempt, final=True)
                event(state)
                out.write(b"X ranks\n")
                out.flush()
                return 0
        if now() - last_beat >= HEARTBEAT:
            last_beat = now()
            out.write(b"H\n")
            out.flush()


# --------------------------------------------------------------------------- main

def main(argv):
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    cmd = argv[1]
    if cmd == "rank":   # agent.py imports rank.py alone for it (supervisor.agent_stub); this for any other caller
        return rank_main(argv)
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    if cmd == "start":
        opts = {"--config": None, "--head-port": None, "--head-addresses": None, "--silence": None}
        it = iter(argv[3:])
        foreground = False
        for a in it:
            if a == "--foreground":
                foreground = True
            elif a in opts:
                opts[a] = next(it, None)
        return cmd_start(argv[2], foreground, opts["--config"], opts["--head-port"], opts["--head-addresses"],
                         opts["--silence"])
    if cmd == "batch":
        return cmd_batch(argv[2])
    if cmd == "stop":
        return cmd_stop(argv[2], argv[3] if len(argv) > 3 else "a request")
    if cmd == "status":
        return cmd_status(argv[2])
    if cmd == "watch":
        ranks, offsets, first, to_end = [], {}, 1, False
        it = iter(argv[3:])
        for a in it:
            if a == "--to-end":
                to_end = True
            elif a == "--attempt":
                first = int(next(it))
            elif a == "--rank":
                ranks.append(int(next(it)))
            elif a == "--offset":
                r, _, n = next(it).partition("=")
                offsets[int(r)] = int(n)
        return cmd_watch(argv[2], ranks, offsets, first, to_end)
    sys.stderr.write("agent.py: unknown command %r\n" % cmd)
    return 2
