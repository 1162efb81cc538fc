#!/usr/bin/env python3
"""orch's run supervisor: the one program orch runs on the cluster for a run.

Shipped with every run (written to <workdir>/.orch/<run id>/agent.py on each host, like
the probe script) and run with the host's python3 (3.8 or newer, standard library only).

    agent.py start RUNDIR          config on stdin; detaches (setsid), prints "ok PID PORT"
    agent.py start RUNDIR --foreground --config FILE [--head-port N]
                                   the same in the foreground, the config read from FILE
                                   ({node} -> $SLURMD_NODENAME) and removed: a Slurm job step
    agent.py batch GOFILE          (Slurm) starts the head's step, then the members' step,
                                   and waits for both: the batch script of the allocation
    agent.py rank -- CMD...        wraps one rank started by mpirun or msrun: records its
                                   pid, and its exit code or signal, for the host's agent
    agent.py watch RUNDIR [--rank N ...] [--offset N=BYTES ...] [--to-end]
                                   streams the run's state (from the head) and the named
                                   ranks' output (from this host) to stdout, until they have
                                   ended (--to-end: until the run has, restarts included)
    agent.py stop RUNDIR REASON    asks the run's head agent to stop the run (from any host)
    agent.py status RUNDIR         this host's view of the run, one JSON document

One agent per host per run. The agent on the launch host is the HEAD: it listens on a TCP
port (an ephemeral one, announced at start), every other host's agent (a MEMBER) connects
to it and authenticates with the run's token. Each agent starts its host's processes as
its own children (every rank for the ranktable launcher, msrun per host, mpirun on the
launch host), so exit codes and signals come from waitpid; ranks that mpirun or msrun
start are wrapped by `agent.py rank`, which reports to its host's agent through files in
the run directory. Members report their ranks to the head every second and on every
change; the head alone decides: fail-fast (job.on_failure), restarts, stalls, time-out,
hosts lost (silent for LOST_AFTER seconds), and the run's final state, which it writes
to RUNDIR/state.json. A member that loses its head stops its own ranks. Nothing of this
needs the controller (`orch up`) once started; the controller, when attached, is one
more watcher of the head's events.
"""

import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

RUN_VAR = "ORCH_RUN_ID"
AGENT_VAR = "ORCH_AGENT"        # set in agents' own environment only: sweeps spare agents
DIR_VAR = "ORCH_RUN_DIR"
ATTEMPT_VAR = "ORCH_ATTEMPT"
RANK_DIRS_VAR = "ORCH_RANK_DIRS"      # job.rank_dirs: each rank starts in workdir/rank_<N>
RANK_OUTPUT_VAR = "ORCH_RANK_OUTPUT"  # `agent.py rank` writes the rank's output to its log itself
WRAPPING_LAUNCHERS = ("mpirun", "msrun", "torchrun")  # their ranks run under `agent.py rank`
ATTEMPT_DIR_TOKEN = "@ORCH_ATTEMPT_DIR@"   # in an argv: this attempt's directory
TICK = 0.1
HEARTBEAT = 1.0
FINAL = ("succeeded", "failed", "stopped", "lost", "stalled", "timeout")
RETRYABLE = ("failed", "stalled")
SLURM_JOB_VAR = "ORCH_SLURM_JOB"
SLURM_JOB_KEYS = ("SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                  "SLURM_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_CPUS_PER_NODE")


def now():
    return time.time()


def write_atomic(path, text, mode=0o600):
    """Write a file under its real name only once complete; never through a planted link."""
    tmp = "%s.%d.%d.tmp" % (path, os.getpid(), int(now() * 1e6))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def attempt_dir(rundir, attempt):
    return os.path.join(rundir, "a%d" % attempt)


def rank_log(adir, rank, launcher):
    """Where rank N's output is in an attempt directory: mpirun's --output-filename layout
    (rank.N, zero-padded by some versions when a host has 10+ ranks), msrun's worker_N.log."""
    if launcher == "msrun":
        return os.path.join(adir, "worker_%d.log" % rank)
    plain = os.path.join(adir, "1", "rank.%d" % rank, "stdout")
    if os.path.exists(plain):
        return plain
    try:
        for name in os.listdir(os.path.join(adir, "1")):
            head, _, num = name.partition(".")
            if head == "rank" and num.isdigit() and int(num) == rank:
                return os.path.join(adir, "1", name, "stdout")
    except OSError:
        pass
    return plain


def describe(code, sig):
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = "signal %d" % sig
        return "killed by signal %d (%s)" % (sig, name)
    if code is None:
        return "no exit code (killed or lost)"
    return "exit code %d" % code


def run_pids(run_id):
    """Every live process of the run on this host but the agents (found by its environment)."""
    needle = ("%s=%s" % (RUN_VAR, run_id)).encode()
    me = os.getpid()
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == me:
            continue
        try:
            with open("/proc/%s/environ" % p, "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if needle in env and (AGENT_VAR + "=1").encode() not in env:
            out.append(int(p))
    return out


def signal_pids(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


# --------------------------------------------------------------------------- messages


class Conn:
    """One TCP peer: newline-delimited JSON both ways."""

    def __init__(self, sock, kind="?"):
        self.sock = sock
        self.kind = kind          # member | watcher | ?
        self.host = None
        self.buf = b""
        self.out = b""
        self.closed = False
        self.last = now()
        sock.setblocking(False)

    def fileno(self):
        return self.sock.fileno()

    def send(self, obj):
        if self.closed:
            return
        self.out += (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        self.flush()

    def flush(self):
        while self.out and not self.closed:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            self.out = self.out[n:]
        if len(self.out) > (8 << 20):  # a peer that reads nothing is not kept in memory
            self.close()

    def read(self):
        """New messages (a list); closes on EOF or error."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return []
        self.last = now()
        self.buf += data
        msgs = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                msgs.append(json.loads(line.decode()))
            except ValueError:
                self.close()
                return msgs
        if len(self.buf) > (1 << 20):
            self.close()
        return msgs

    def close(self):
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


def connect(address, port, timeout):
    s = socket.create_connection((address, int(port)), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# --------------------------------------------------------------------------- this host's processes


class Local:
    """This host's part of the run: the processes the agent starts, the ranks mpirun or msrun
    start (wrapped by `agent.py rank`), their states, stopping them, their output's progress."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.run_id = cfg["run_id"]
        self.rundir = cfg["rundir"]
        self.host = cfg["host"]
        self.launcher = cfg["launcher"]
        self.attempt = 0
        self.children = {}        # pid -> proc key
        self.procs = {}           # key -> record
        self.ranks = {}           # rank -> record
        self.stopping = None      # (reason, deadline, killed)
        self.last_output = 0.0
        self.sizes = {}
        self.changed = True
        self.stop_state = "stopped"   # what a rank that our stop ended is: stopped (or lost)

    # ---- starting
    def start(self, attempt):
        self.attempt = attempt
        self.stopping = None
        adir = attempt_dir(self.rundir, attempt)
        os.makedirs(adir, mode=0o755, exist_ok=True)
        self.flip_log_link(adir)
        self.last_output = now()
        self.sizes = {}
        for r in self.cfg["ranks"]:
            self.ranks[r["rank"]] = {"rank": r["rank"], "host": self.host, "device": r["device"], "pid": None,
                                     "state": "pending", "exit_code": None, "signal": None,
                                     "start": None, "end": None, "attempt": attempt}
        self.procs = {}
        for p in self.cfg["procs"]:
            self.spawn(p, attempt, adir)
        self.changed = True

    def flip_log_link(self, adir):
        """workdir/<log_dir> points at the latest attempt's logs (what mpirun users look at); a real
        directory there (an earlier hand-run) is moved aside, never deleted."""
        link = self.cfg["log_link"]
        try:
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if os.path.isdir(link) and not os.path.islink(link):
                aside = "%s.before-orch-%d" % (link, int(now()))
                os.rename(link, aside)
            tmp = "%s.orch-%d" % (link, os.getpid())
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(adir, tmp)
            os.replace(tmp, link)
        except OSError as exc:
            self.note("could not point %s at this run's logs: %s" % (link, exc))

    def note(self, text):
        sys.stderr.write("orch-agent %s: %s\n" % (self.host, text))
        sys.stderr.flush()

    def spawn(self, p, attempt, adir):
        rec = {"key": p["key"], "rank": p.get("rank"), "pid": None, "exit_code": None, "signal": None,
               "start": now(), "end": None}
        self.procs[p["key"]] = rec
        log = os.path.join(adir, p["log"])
        env = dict(os.environ)
        env.pop(AGENT_VAR, None)
        if SLURM_JOB_VAR in env:  # a Slurm job step: the processes see the whole allocation again
            env.update(json.loads(env.pop(SLURM_JOB_VAR)))
            env.setdefault("OMPI_MCA_plm_slurm_args", "--overlap")  # mpirun's orteds share our nodes
        env.update(p["env"])
        env.update({RUN_VAR: self.run_id, DIR_VAR: self.rundir, ATTEMPT_VAR: str(attempt)})
        rank = p.get("rank")
        try:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            if p.get("env_log"):  # seed 001 keeps each rank's environment beside its log
                write_atomic(os.path.join(os.path.dirname(log), "env.log"),
                             "".join("%s=%s\n" % kv for kv in sorted(env.items())))
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            self.note("cannot open %s: %s" % (log, exc))
            self.ended(rec, 126, None)
            return
        try:
            cwd = p["cwd"]
            if rank is not None and env.get(RANK_DIRS_VAR):
                cwd = enter_rank_dir(cwd, rank)
            argv = [a.replace(ATTEMPT_DIR_TOKEN, adir) for a in p["argv"]]
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        except OSError as exc:
            os.write(fd, ("orch: cannot start %s: %s\n" % (p["argv"][0], exc.strerror)).encode())
            os.close(fd)
            self.ended(rec, 127, None)
            return
        os.close(fd)
        rec["pid"] = proc.pid
        proc.returncode = 0   # we reap it ourselves (waitpid); keep Popen from doing it too
        self.children[proc.pid] = p["key"]
        if rank is not None:
            self.ranks[rank].update(pid=proc.pid, state="running", start=rec["start"])

    # ---- watching
    def poll(self):
        """Reap children, read wrapped ranks' reports, follow output. True when something changed."""
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            key = self.children.pop(pid, None)
            if key is None:
                continue
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            self.ended(self.procs[key], code, sig)
        if self.launcher in WRAPPING_LAUNCHERS:
            self.read_wrapped()
        self.watch_output()
        changed, self.changed = self.changed, False
        return changed

    def ended(self, rec, code, sig):
        rec.update(exit_code=code, signal=sig, end=now())
        self.changed = True
        if rec.get("rank") is not None:
            self.rank_ended(rec["rank"], code, sig, rec["end"])

    def rank_ended(self, rank, code, sig, when):
        r = self.ranks.get(rank)
        if r is None or r["end"] is not None:
            return
        if self.stopping is not None and (code != 0 or sig):
            state = self.stop_state
        else:
            state = "exited" if code == 0 and not sig else "failed"
        r.update(exit_code=code, signal=sig, end=when, state=state)
        self.changed = True

    def read_wrapped(self):
        adir = attempt_dir(self.rundir, self.attempt)
        for rank, r in self.ranks.items():
            if r["end"] is not None:
                continue
            if r["pid"] is None:
                pid = read_json(os.path.join(adir, "rank.%d.pid" % rank))
                if pid:
                    r.update(pid=pid.get("pid"), start=pid.get("start"), state="running")
                    self.changed = True
            ex = read_json(os.path.join(adir, "rank.%d.exit" % rank))
            if ex:
                self.rank_ended(rank, ex.get("exit_code"), ex.get("signal"), ex.get("end") or now())

    def watch_output(self):
        adir = attempt_dir(self.rundir, self.attempt)
        for rank in self.ranks:
            try:
                size = os.stat(rank_log(adir, rank, self.launcher)).st_size
            except OSError:
                continue
            if size != self.sizes.get(rank):
                self.sizes[rank] = size
                self.last_output = now()

    def live(self):
        """Processes of the run still alive here (children, and any other process of the run)."""
        return bool(self.children) or bool(run_pids(self.run_id))

    def pending_ranks(self):
        return [r for r in self.ranks.values() if r["end"] is None]

    # ---- stopping
    def stop(self, reason, grace):
        if self.stopping is not None:
            return
        self.stopping = [reason, now() + grace, False]
        self.signal_all(signal.SIGTERM)
        self.changed = True

    def signal_all(self, sig):
        for pid in list(self.children):
            try:
                os.killpg(pid, sig)
            except OSError:
                pass
        signal_pids(run_pids(self.run_id), sig)

    def stop_tick(self):
        """Advance a stop: KILL what outlived the grace period. True once nothing of the run lives."""
        if self.stopping is None:
            return False
        if not self.live():
            self.finish_pending(self.stop_state)
            return True
        if now() > self.stopping[1] and not self.stopping[2]:
            self.stopping[2] = True
            self.signal_all(signal.SIGKILL)
        return False

    def finish_pending(self, state):
        for r in self.pending_ranks():
            r.update(state=state, end=now())
            self.changed = True

    def dump_stacks(self):
        """A stalled run: each rank's Python stack, with py-spy when the host has it, else
        SIGABRT, which makes a rank started with PYTHONFAULTHANDLER=1 print every thread's stack
        into its own log before it ends."""
        adir = attempt_dir(self.rundir, self.attempt)
        spy = shutil.which("py-spy")
        for rank, r in sorted(self.ranks.items()):
            pid = r.get("pid")
            if not pid or r["end"] is not None:
                continue
            if spy:
                out = os.path.join(os.path.dirname(rank_log(adir, rank, self.launcher)), "stacks.txt")
                try:
                    res = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, timeout=20)
                    write_atomic(out, res.stdout.decode("utf-8", "replace") + res.stderr.decode("utf-8", "replace"),
                                 0o644)
                    continue
                except (OSError, subprocess.SubprocessError):
                    pass
            for p in [pid] + children_of(pid):
                if is_python(p):
                    signal_pids([p], signal.SIGABRT)

    def report(self):
        return {"host": self.host, "attempt": self.attempt, "ranks": list(self.ranks.values()),
                "procs": list(self.procs.values()), "out": self.last_output,
                "stopping": self.stopping[0] if self.stopping else None,
                "live": bool(self.children) or bool(self.pending_ranks())}


def children_of(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/stat" % p) as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(p))
                out.extend(children_of(int(p)))
    return out


def is_python(pid):
    try:
        return os.path.basename(os.readlink("/proc/%d/exe" % pid)).startswith("python")
    except OSError:
        return False


# --------------------------------------------------------------------------- the agent


class Agent:
    def __init__(self, cfg, server=None, lock_fd=None):
        self.cfg = cfg
        self.rundir = cfg["rundir"]
        self.head = cfg["role"] == "head"
        self.token = cfg["token"]
        self.local = Local(cfg)
        self.server = server
        self.lock_fd = lock_fd
        self.conns = []
        self.head_conn = None
        self.stop_request = None
        self.started = now()
        self.last_beat = 0.0
        self.done = False
        self.grace = float(cfg.get("grace", 5))
        self.lost_after = float(cfg.get("lost_after", 10))
        if self.head:
            self.hosts = {h: {"joined": False, "last": now(), "report": None} for h in cfg["hosts"]}
            self.hosts[cfg["host"]]["joined"] = True
            self.state = {"run": cfg["run_id"], "state": "starting", "head": cfg["host"], "attempt": 0,
                          "attempts": [], "ranks": cfg["all_ranks"], "lost": [], "message": "",
                          "first_failure": None, "started": self.started, "ended": None,
                          "launcher": cfg["launcher"], "restarts": cfg.get("restarts", 0)}
            self.phase = "join"
            self.phase_until = now() + float(cfg.get("join_timeout", 60))
            self.outcome = None
        self.save()

    # ---- I/O
    def save(self):
        doc = self.state if self.head else {"run": self.cfg["run_id"], "host": self.cfg["host"],
                                            "role": "member", **self.local.report(),
                                            "state": getattr(self, "member_state", "running")}
        doc = dict(doc, agent_pid=os.getpid(), updated=now())
        try:
            write_atomic(os.path.join(self.rundir, "state.json"), json.dumps(doc), 0o644)
        except OSError as exc:
            self.local.note("cannot write state: %s" % exc)

    def broadcast(self, msg, kinds=("member",)):
        for c in self.conns:
            if c.kind in kinds:
                c.send(msg)

    def loop(self):
        signal.signal(signal.SIGTERM, lambda *a: self.request_stop("a signal (SIGTERM) to the run's supervisor"))
        signal.signal(signal.SIGINT, lambda *a: self.request_stop("a signal (SIGINT) to the run's supervisor"))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        if not self.head:
            self.join()
        while not self.done:
            self.io(TICK)
            changed = self.local.poll()
            if self.head:
                self.head_tick(changed)
            else:
                self.member_tick(changed)

    def io(self, timeout):
        socks = [c for c in self.conns if not c.closed]
        if self.server is not None:
            socks.append(self.server)
        if self.head_conn is not None and not self.head_conn.closed:
            socks.append(self.head_conn)
        try:
            ready, _, _ = select.select(socks, [], [], timeout)
        except InterruptedError:
            return
        for s in ready:
            if s is self.server:
                try:
                    sock, _ = self.server.accept()
                except OSError:
                    continue
                self.conns.append(Conn(sock))
            elif s is self.head_conn:
                for m in s.read():
                    self.on_head_message(m)
            else:
                for m in s.read():
                    self.on_message(s, m)
        self.conns = [c for c in self.conns if not c.closed]
        for c in self.conns:
            c.flush()

    # ---- member
    def join(self):
        deadline = now() + float(self.cfg.get("join_timeout", 60))
        err = None
        while now() < deadline and self.stop_request is None:
            try:
                s = connect(self.cfg["head_address"], self.cfg["head_port"], 5)
                self.head_conn = Conn(s, "head")
                self.head_conn.send({"t": "hello", "token": self.token, "host": self.cfg["host"]})
                return
            except OSError as exc:
                err = exc
                time.sleep(0.5)
        self.local.note("could not reach the run's head at %s:%s: %s" % (self.cfg["head_address"],
                                                                          self.cfg["head_port"], err))
        self.member_state = "lost"
        self.save()
        self.done = True

    def on_head_message(self, m):
        t = m.get("t")
        if t == "start":
            self.local.start(int(m["attempt"]))
        elif t == "stop":
            self.local.stop(m.get("reason", "stopped"), self.grace)
        elif t == "dump":
            self.local.dump_stacks()
        elif t == "exit":
            self.member_state = m.get("state", "stopped")
            self.local.stop("the run ended", self.grace)
            self.exiting = True

    def member_tick(self, changed):
        hc = self.head_conn
        if hc is None:
            return
        lost = hc.closed or now() - hc.last > self.lost_after
        if lost and not getattr(self, "exiting", False):
            if self.local.stopping is None:
                self.local.note("lost the run's head (%s): stopping this host's ranks" % self.cfg["head_address"])
                self.member_state = "lost"
                self.local.stop_state = "lost"
                self.local.stop("lost contact with the launch host", self.grace)
            self.exiting = True
        if self.stop_request and self.local.stopping is None:
            self.local.stop(self.stop_request, self.grace)
            hc.send({"t": "stop", "token": self.token, "reason": self.stop_request})
        if self.local.stopping is not None and self.local.stop_tick():
            changed = True
        if changed or now() - self.last_beat >= HEARTBEAT:
            self.last_beat = now()
            hc.send({"t": "report", **self.local.report()})
            self.save()
        if getattr(self, "exiting", False) and (self.local.stopping is None or not self.local.live()):
            self.local.finish_pending(self.local.stop_state)
            if getattr(self, "member_state", "running") == "running":
                self.member_state = "stopped"
            hc.send({"t": "report", **self.local.report()})
            hc.flush()
            self.save()
            self.done = True

    # ---- head
    def on_message(self, c, m):
        t = m.get("t")
        if c.kind == "?":
            if m.get("token") != self.token:
                c.close()
                return
            if t == "hello" and m.get("host") in self.hosts:
                c.kind, c.host = "member", m["host"]
                h = self.hosts[c.host]
                h.update(joined=True, last=now(), conn=c)
                if self.phase in ("run",):  # joined late: start with everyone else
                    c.send({"t": "start", "attempt": self.state["attempt"]})
                elif self.phase == "done":
                    c.send({"t": "exit", "state": self.state["state"]})
                return
            if t == "watch":
                c.kind = "watcher"
                c.send({"t": "state", "state": self.state})
                return
            if t == "stop":
                self.request_stop(m.get("reason") or "a request")
                c.kind = "watcher"
                c.send({"t": "state", "state": self.state})
                return
            c.close()
            return
        if c.kind == "member":
            h = self.hosts.get(c.host)
            h["last"] = now()
            if t == "report":
                h["report"] = m
                self.merge(m)
            elif t == "stop":
                self.request_stop(m.get("reason") or "a request")
        elif c.kind == "watcher" and t == "stop":
            self.request_stop(m.get("reason") or "a request")

    def request_stop(self, reason):
        if self.stop_request is None:
            self.stop_request = reason

    def merge(self, report):
        if report.get("attempt") != self.state["attempt"]:
            return
        by_rank = {r["rank"]: r for r in self.state["ranks"]}
        for r in report["ranks"]:
            if r["rank"] in by_rank:
                by_rank[r["rank"]].update(r)

    def publish(self):
        self.save()
        self.broadcast({"t": "state", "state": self.state}, kinds=("watcher",))

    def head_tick(self, changed):
        if changed:
            self.merge(self.local.report())
        for name, h in self.hosts.items():
            if name != self.cfg["host"] and h["joined"] and h.get("conn") is not None:
                c = h["conn"]
                silent = now() - h["last"] > self.lost_after
                if (c.closed or silent) and name not in self.state["lost"] and self.phase != "done":
                    self.state["lost"].append(name)
                    changed = True
        getattr(self, "phase_" + self.phase)()
        if changed or now() - self.last_beat >= HEARTBEAT:
            self.last_beat = now()
            self.publish()
            self.broadcast({"t": "hb"})   # members tell a silent head from a lost one

    def phase_join(self):
        missing = [n for n, h in self.hosts.items() if not h["joined"]]
        if self.stop_request:
            self.end_attempt("stopped", "stopped by %s before the ranks started" % self.stop_request)
        elif not missing:
            self.start_attempt(1)
        elif now() > self.phase_until:
            self.state["lost"] = missing
            self.end_attempt("lost", "the supervisor on %s never reached the launch host's (%s:%s); "
                             "nothing was started" % (", ".join(missing), self.cfg["head_address"],
                                                     self.server.getsockname()[1]))

    def start_attempt(self, k):
        self.phase = "run"
        self.state.update(state="running", attempt=k, first_failure=None)
        self.state["attempts"].append({"attempt": k, "state": "running", "start": now(), "end": None,
                                       "message": "", "first_failure": None})
        for r in self.state["ranks"]:
            r.update(state="pending", pid=None, exit_code=None, signal=None, start=None, end=None, attempt=k)
        self.broadcast({"t": "start", "attempt": k})
        self.local.start(k)
        self.merge(self.local.report())
        self.attempt_started = now()
        self.publish()

    def name_first_failure(self):
        """The failure named is the rank that ended first, on whichever host (the others most
        often died of it: mpirun and msrun kill a failed rank's siblings). Named again once every
        host has reported, when the run's attempt ends; ranks killed after it by a launcher's
        SIGTERM/SIGKILL count as stopped, not failed."""
        st = self.state
        fails = self.failures()
        if not fails:
            return None
        when, r, how = fails[0]
        st["first_failure"] = {"rank": r["rank"], "host": r["host"], "device": r["device"],
                               "exit_code": r["exit_code"], "signal": r["signal"], "how": how,
                               "attempt": st["attempt"]}
        return st["first_failure"]

    def settle_failures(self):
        ff = self.name_first_failure()
        if ff is None:
            return None
        first_end = self.failures()[0][0]
        for r in self.state["ranks"]:
            if (r["state"] == "failed" and r["rank"] != ff["rank"] and r["signal"] in (signal.SIGTERM, signal.SIGKILL)
                    and (r.get("end") or 0) >= first_end):
                r["state"] = "stopped"
        return ff

    def failures(self):
        """(when, rank record, how) of every failed rank, and failed launchers (mpirun/msrun)."""
        out = []
        for r in self.state["ranks"]:
            if r["state"] == "failed":
                out.append((r.get("end") or now(), r, describe(r["exit_code"], r["signal"])))
        return sorted(out, key=lambda f: (f[0], f[1]["rank"]))

    def launcher_results(self):
        """{key: (host, proc record)} of every launcher process (mpirun, msrun) on every host."""
        out = {}
        reports = [self.local.report()] + [h["report"] for n, h in self.hosts.items()
                                            if n != self.cfg["host"] and h["report"]]
        for rep in reports:
            if rep.get("attempt") != self.state["attempt"]:
                continue
            for p in rep["procs"]:
                if p.get("rank") is None:
                    out[p["key"]] = (rep["host"], p)
        return out

    def phase_run(self):
        cfg = self.cfg
        st = self.state
        ranks = st["ranks"]
        launchers = self.launcher_results()
        self.name_first_failure()
        if self.stop_request:
            return self.end_attempt("stopped", "stopped by %s" % self.stop_request)
        if st["lost"]:
            lost = ", ".join(st["lost"])
            return self.end_attempt("lost", "lost contact with host %s (%s): its supervisor stopped answering "
                                    "for %gs. The run was stopped on every other host; a supervisor that loses "
                                    "the launch host stops its own ranks. Once the host is reachable, `orch status "
                                    "--run %s` shows them and `orch down --run %s` cleans up"
                                    % (lost, rank_ranges(r["rank"] for r in ranks if r["host"] in st["lost"]),
                                       self.lost_after, cfg["run_id"], cfg["run_id"]))
        ff = st["first_failure"]
        all_ended = all(r["end"] is not None for r in ranks)
        if ff is not None and (cfg["on_failure"] == "stop" or all_ended):
            return self.end_attempt("failed", "rank %d on %s (device %s) failed: %s"
                                    % (ff["rank"], ff["host"], ff["device"], ff["how"]))
        failed_launcher = [(k, h, p) for k, (h, p) in sorted(launchers.items())
                           if p["end"] is not None and (p["exit_code"] != 0 or p["signal"])]
        ended_launchers = all(p["end"] is not None for _, p in launchers.values()) and launchers
        if failed_launcher or ended_launchers:
            # a launcher ended: its ranks report within moments (their wrapper writes before exiting)
            if not hasattr(self, "launcher_end"):
                self.launcher_end = now()
            if not all_ended and now() - self.launcher_end < 5.0:
                return
            if failed_launcher and ff is None:
                k, h, p = failed_launcher[0]
                log = os.path.join(attempt_dir(self.rundir, st["attempt"]), "%s.log" % k.split(".")[0])
                said = tail_lines(log) if h == self.cfg["host"] else ""
                return self.end_attempt("failed", "%s on %s failed: %s (its own output: %s)%s"
                                        % (k.split(".")[0], h, describe(p["exit_code"], p["signal"]), log,
                                           (", ending:\n" + said) if said else ""))
            if not all_ended:
                missing = [r["rank"] for r in ranks if r["end"] is None]
                return self.end_attempt("failed", "%s never reported an exit code" % rank_ranges(missing))
        if all_ended and ff is None and (not launchers or ended_launchers):
            return self.end_attempt("succeeded", "all %d ranks exited 0" % len(ranks))
        stall = cfg.get("stall_timeout")
        if stall:
            last = max([self.local.last_output, self.attempt_started] +
                       [h["report"]["out"] for h in self.hosts.values() if h["report"]
                        and h["report"].get("attempt") == st["attempt"]])
            if now() - last > float(stall):
                self.broadcast({"t": "dump"})
                self.local.dump_stacks()
                return self.end_attempt("stalled", "no rank wrote any output for %gs: stacks captured "
                                        "(in each rank's log, or stacks.txt beside it with py-spy)" % float(stall),
                                        settle=2.0)
        timeout = cfg.get("timeout")
        if timeout and now() - self.started > float(timeout):
            return self.end_attempt("timeout", "the job did not finish within job.timeout = %gs (timed out)"
                                    % float(timeout))

    def end_attempt(self, outcome, message, settle=0.0):
        st = self.state
        self.outcome = (outcome, message)
        if st["attempts"]:
            st["attempts"][-1].update(state=outcome, end=now(), message=message,
                                      first_failure=st["first_failure"])
        self.phase = "stopping"
        self.phase_until = now() + settle + self.grace + 5.0
        self.settle_until = now() + settle
        st["message"] = message
        self.stop_sent = False
        self.publish()

    def phase_stopping(self):
        if not self.stop_sent and now() >= self.settle_until:
            self.stop_sent = True
            self.broadcast({"t": "stop", "reason": self.outcome[1]})
            self.local.stopping = None
            self.local.stop(self.outcome[1], self.grace)
        if not self.stop_sent:
            return
        local_done = self.local.stop_tick() or not self.local.live()
        others = [h for n, h in self.hosts.items() if n != self.cfg["host"] and n not in self.state["lost"]
                  and h["joined"]]
        remote_done = all(h["report"] is not None and not h["report"].get("live") for h in others)
        if not ((local_done and remote_done) or now() > self.phase_until):
            return
        for r in self.state["ranks"]:
            if r["end"] is None:
                r.update(state="lost" if r["host"] in self.state["lost"] else "stopped", end=now())
        outcome, message = self.outcome
        if outcome == "failed" and self.state["first_failure"] is not None:
            ff = self.settle_failures()   # every host has reported by now
            message = "rank %d on %s (device %s) failed: %s" % (ff["rank"], ff["host"], ff["device"], ff["how"])
            self.outcome = (outcome, message)
            if self.state["attempts"]:
                self.state["attempts"][-1].update(message=message, first_failure=ff)
        k = self.state["attempt"]
        if outcome in RETRYABLE and k <= int(self.cfg.get("restarts", 0)) and not self.stop_request:
            self.phase = "delay"
            self.phase_until = now() + float(self.cfg.get("restart_delay", 0))
            self.state["message"] = "%s; restarting (attempt %d of %d)" % (message, k + 1,
                                                                           int(self.cfg["restarts"]) + 1)
            self.publish()
            return
        self.finish(outcome, message)

    def phase_delay(self):
        if self.stop_request:
            return self.finish("stopped", "stopped by %s" % self.stop_request)
        if now() >= self.phase_until:
            if hasattr(self, "launcher_end"):
                del self.launcher_end
            for h in self.hosts.values():
                h["report"] = None
            self.start_attempt(self.state["attempt"] + 1)

    def phase_done(self):
        live = [h for n, h in self.hosts.items() if n != self.cfg["host"] and n not in self.state["lost"]
                and h.get("conn") is not None and not h["conn"].closed]
        if not live or now() > self.phase_until:
            self.done = True

    def finish(self, outcome, message):
        st = self.state
        st.update(state=outcome, message=message, ended=now())
        if st["attempts"] and outcome == "stopped" and st["attempts"][-1]["state"] not in FINAL:
            st["attempts"][-1].update(state=outcome, end=now(), message=message)
        self.phase = "done"
        self.phase_until = now() + 3.0
        self.broadcast({"t": "exit", "state": outcome})
        self.publish()


def tail_lines(path, lines=6, limit=800):
    """The last non-empty lines of a launcher's own log (what mpirun said when it failed)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # OpenMPI wraps its advice in ------ blocks: keep what stands outside them (ssh's own error,
    # a rank's last words) and the first line of each block (its summary).
    kept, inside, first = [], False, False
    for ln in text.splitlines():
        bare = ln.strip()
        if len(bare) >= 10 and set(bare) <= set("-="):
            inside, first = not inside, not inside
            continue
        if bare and (not inside or first):
            kept.append(ln.rstrip())
            first = False
    return "\n".join("  " + ln for ln in kept[-lines:])[-limit:]


def rank_ranges(ranks):
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return "rank %d" % ranks[0]
    parts, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else "%d-%d" % (start, prev))
        if r is not None:
            start = prev = r
    return "ranks " + ",".join(parts)


# --------------------------------------------------------------------------- commands


def lock_workdir(workdir, run_id):
    """One live run per (host, workdir): an exclusive lock, held by the agent for the run's life.
    Returns the lock's fd, or the id of the run holding it."""
    d = os.path.join(workdir, ".orch")  # launchers.orch_dir and LOCK on the controller's side
    os.makedirs(d, mode=0o755, exist_ok=True)
    fd = os.open(os.path.join(d, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "?"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, run_id.encode(), 0)
    return fd, None


def cmd_start(rundir, foreground=False, config=None, head_port=None):
    if config:
        path = config.replace("{node}", os.environ.get("SLURMD_NODENAME", ""))
        with open(path) as fh:
            cfg = json.load(fh)
        os.unlink(path)  # it may hold secret env values: read once
    else:
        cfg = json.loads(sys.stdin.read())
        sys.stdin.close()
    if head_port:
        cfg["head_port"] = int(head_port)
    os.makedirs(rundir, mode=0o755, exist_ok=True)
    lock_fd, holder = lock_workdir(cfg["workdir"], cfg["run_id"])
    if lock_fd is None:
        print("busy %s" % holder)
        return 3
    server = None
    if cfg["role"] == "head":
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((cfg.get("bind", "0.0.0.0"), 0))
        server.listen(256)
        server.setblocking(False)
        cfg["head_port"] = server.getsockname()[1]
    public = {k: cfg[k] for k in ("run_id", "host", "role", "head_address", "head_port", "launcher")}
    public["token"] = cfg["token"]
    write_atomic(os.path.join(rundir, "agent.json"), json.dumps(public), 0o600)
    if foreground:
        sys.stdout.write("ok %d %s\n" % (os.getpid(), cfg.get("head_port") or 0))
        sys.stdout.flush()
        return run_agent(cfg, server, lock_fd, None)
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        child = os.read(r, 64).decode().strip()
        os.close(r)
        if not child:
            print("failed to start the supervisor (see %s)" % os.path.join(rundir, "agent.log"))
            return 1
        print("ok %s %s" % (child, cfg.get("head_port") or 0))
        return 0
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    os._exit(run_agent(cfg, server, lock_fd, w))


def run_agent(cfg, server, lock_fd, ready_fd):
    """Be the run's agent on this host until the run ends: stdio to RUNDIR/agent.log; our pid
    written to `ready_fd` (the detaching parent's pipe) once running."""
    log = os.open(os.path.join(cfg["rundir"], "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                  0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.environ[AGENT_VAR] = "1"
    try:
        agent = Agent(cfg, server, lock_fd)
        if ready_fd is not None:
            os.write(ready_fd, ("%d\n" % os.getpid()).encode())
            os.close(ready_fd)
        agent.loop()
    except BaseException:
        import traceback
        traceback.print_exc()
        return 1
    # the head's exit status is the run's (a Slurm job step: the job ends COMPLETED only if it succeeded)
    return 0 if not agent.head or agent.state.get("state") == "succeeded" else 1


CONFIG = "config.{node}.json"  # in the run directory: a Slurm job step's supervisor configuration


def step_argv(nodes, python, rundir, *extra):
    """One Slurm job step starting this run's supervisor once on each of `nodes` (what `orch plan`
    shows and `batch` runs). `python`: its argv (a list), or one word."""
    python = [python] if isinstance(python, str) else list(python)
    return ["srun", "--overlap", "--nodes=%d" % len(nodes), "--ntasks=%d" % len(nodes), "--ntasks-per-node=1",
            "--nodelist=" + ",".join(nodes), "--kill-on-bad-exit=0"] + python + [os.path.join(rundir, "agent.py"),
            "start", rundir, "--foreground", "--config", os.path.join(rundir, CONFIG)] + list(extra)


def cmd_batch(gofile):
    """Slurm: the batch script's part. The go file (from orch) names the run directory and the
    nodes; start the head's supervisor as a job step, read its port, start the members' as a
    second step, wait for both. Exits with the head's status."""
    with open(gofile) as fh:
        rundir = fh.readline().strip()
        spec = json.loads(fh.readline())
    os.unlink(gofile)  # once: a requeued job waits for a new go instead of repeating this run
    head, members = spec["head"], spec["members"]
    log = open(os.path.join(rundir, "batch.log"), "ab", buffering=0)

    def step(nodes, *extra):
        return step_argv(nodes, spec.get("python", "python3"), rundir, *extra)

    env = dict(os.environ, ORCH_AGENT="1")
    env[RUN_VAR] = spec["run_id"]
    # A step's SLURM_NODELIST, SLURM_TASKS_PER_NODE... describe the step (one node); what the
    # supervisors start (mpirun above all) must see the job's, as in the batch script.
    env[SLURM_JOB_VAR] = json.dumps({k: v for k, v in os.environ.items() if k in SLURM_JOB_KEYS})
    head_proc = subprocess.Popen(step([head]), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                 env=env)
    line = b""
    deadline = now() + float(spec.get("start_timeout", 120))
    while not line.endswith(b"\n") and now() < deadline:
        ready, _, _ = select.select([head_proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(head_proc.stdout.fileno(), 256)
            if not chunk:
                break
            line += chunk
    parts = line.decode("utf-8", "replace").split()
    if parts[:1] != ["ok"] or len(parts) != 3:
        log.write(("orch batch: the head's supervisor did not start: %r\n" % line).encode())
        head_proc.kill()
        head_proc.wait()
        return 1
    member_proc = None
    if members:
        member_proc = subprocess.Popen(step(members, "--head-port", parts[2]), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=log, env=env)
    rc = head_proc.wait()
    if member_proc is not None:
        try:
            member_proc.wait(timeout=float(spec.get("members_grace", 60)))
        except subprocess.TimeoutExpired:
            member_proc.terminate()
            member_proc.wait()
    return rc


def enter_rank_dir(workdir, rank):
    """job.rank_dirs: the rank's own directory, workdir/rank_<N>, holding a link to each top-level
    entry of workdir (the synced code and data), so that the command runs as from workdir while
    what the rank writes at fixed relative paths (checkpoints, ms_log/, kernel_meta/) stays its
    own. Links already there (a restart) are kept. Returns the directory."""
    d = os.path.join(workdir, "rank_%d" % rank)
    try:
        os.mkdir(d, 0o755)
    except FileExistsError:
        pass
    have = set(os.listdir(d))
    for name in os.listdir(workdir):
        if name.startswith((".", "rank_")) or name in have:
            continue
        try:
            os.symlink(os.path.join("..", name), os.path.join(d, name))
        except OSError:
            pass
    return d


def cmd_rank(argv):
    """Run one rank under mpirun/msrun/torchrun: its pid and its end (exit code or signal) go to
    files the host's agent reads. Signals are passed on to the rank; its exit status is passed
    up. With ORCH_RANK_OUTPUT (torchrun, which keeps no per-rank files of its own) the rank's
    output goes to its log, as mpirun lays it out; with ORCH_RANK_DIRS it starts in its own
    directory (enter_rank_dir)."""
    rundir = os.environ.get(DIR_VAR, "")
    attempt = os.environ.get(ATTEMPT_VAR, "1")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK_ID") or os.environ.get("RANK") or ""
    adir = attempt_dir(rundir, int(attempt))
    out, cwd = None, None
    if rank.isdigit() and os.environ.get(RANK_DIRS_VAR):
        cwd = enter_rank_dir(os.getcwd(), int(rank))
    if rank.isdigit() and rundir and os.environ.get(RANK_OUTPUT_VAR):
        log = rank_log(adir, int(rank), "mpirun")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT if out is not None else None)
    except OSError as exc:
        msg = "orch: cannot start %s: %s\n" % (argv[0], exc.strerror)
        os.write(out, msg.encode()) if out is not None else sys.stderr.write(msg)
        code, sig, start = 127, None, now()
        proc = None
    else:
        start = now()
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, lambda n, f: proc.send_signal(n))
        if rank.isdigit() and rundir:
            try:
                write_atomic(os.path.join(adir, "rank.%s.pid" % rank), json.dumps({"pid": proc.pid, "start": start}),
                             0o644)
            except OSError:
                pass
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
        code, sig = (rc, None) if rc >= 0 else (None, -rc)
    if out is not None:
        os.close(out)
    if rank.isdigit() and rundir:
        try:
            write_atomic(os.path.join(adir, "rank.%s.exit" % rank),
                         json.dumps({"exit_code": code, "signal": sig, "start": start, "end": now()}), 0o644)
        except OSError:
            pass
    if sig:  # die of the same signal, so mpirun/msrun see what the rank saw
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass    # SIGKILL, SIGSTOP: always the default
        os.kill(os.getpid(), sig)
        return 128 + sig
    return code if code is not None else 1


def cmd_stop(rundir, reason):
    """Ask the head to stop the run; wait (bounded) for its final state; print it."""
    info = read_json(os.path.join(rundir, "agent.json"))
    if not info:
        print(json.dumps({"stop": "no supervisor here"}))
        return 0
    try:
        s = connect(info["head_address"] if info["role"] != "head" else "127.0.0.1", info["head_port"], 5)
    except OSError as exc:
        print(json.dumps({"stop": "head unreachable: %s" % exc}))
        return 0
    c = Conn(s, "watcher")
    c.send({"t": "stop", "token": info["token"], "reason": reason})
    deadline = now() + float(os.environ.get("ORCH_STOP_WAIT", "20"))
    last = None
    while now() < deadline and not c.closed:
        select.select([c], [], [], 0.5)
        for m in c.read():
            if m.get("t") == "state":
                last = m["state"]
                if last.get("state") in FINAL:
                    print(json.dumps({"stop": "done", "state": last}))
                    return 0
    print(json.dumps({"stop": "sent", "state": last}))
    return 0


def cmd_status(rundir):
    doc = read_json(os.path.join(rundir, "state.json")) or {}
    pid = doc.get("agent_pid")
    alive = False
    if pid:
        try:
            with open("/proc/%d/environ" % int(pid), "rb") as fh:
                alive = ("%s=%s" % (RUN_VAR, doc.get("run"))).encode() in fh.read().split(b"\0")
        except (OSError, ValueError):
            pass
    doc["agent_alive"] = alive
    doc["live_pids"] = run_pids(doc["run"]) if doc.get("run") else []
    print(json.dumps(doc))
    return 0


def wait_agent_exit(rundir, limit):
    """Wait (bounded) until this host's supervisor of the run has exited."""
    doc = read_json(os.path.join(rundir, "state.json")) or {}
    pid, run = doc.get("agent_pid"), doc.get("run")
    deadline = now() + limit
    while pid and now() < deadline:
        try:
            with open("/proc/%d/environ" % int(pid), "rb") as fh:
                if ("%s=%s" % (RUN_VAR, run)).encode() not in fh.read().split(b"\0"):
                    return
        except (OSError, ValueError):
            return
        time.sleep(0.05)


class Tail:
    """Output of one rank on this host, read as it grows (attempt by attempt)."""

    def __init__(self, rank, offset, attempt):
        self.rank, self.offset, self.attempt = rank, offset, attempt


def cmd_watch(rundir, ranks, offsets, first_attempt=1, to_end=False):
    """Stream to stdout, until the run ends (or every named rank has ended, unless `to_end`):
         E <json>\\n           the head's state (on every change)
         O <rank> <attempt> <n>\\n<n bytes>   new output of a named rank on this host
         H\\n                  at least once a second (the reader's sign of life)"""
    info = read_json(os.path.join(rundir, "agent.json")) or {}
    out = sys.stdout.buffer
    launcher = info.get("launcher", "mpirun")
    tails = {r: Tail(r, offsets.get(r, 0), first_attempt) for r in ranks}
    conn = None
    try:
        addr = info["head_address"] if info.get("role") != "head" else "127.0.0.1"
        conn = Conn(connect(addr, info["head_port"], 5), "head")
        conn.send({"t": "watch", "token": info["token"]})
    except (OSError, KeyError):
        conn = None
    state = None
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

    while True:
        if conn is not None and not conn.closed:
            select.select([conn], [], [], TICK)
            for m in conn.read():
                last_msg = now()
                if m.get("t") == "state":
                    state = m["state"]
                    out.write(b"E " + json.dumps(state, separators=(",", ":")).encode() + b"\n")
        else:
            time.sleep(TICK)
        if conn is None or conn.closed or now() - last_msg > float(os.environ.get("ORCH_LOST_AFTER", "10")):
            # the head is gone: what the cluster wrote is the last word
            doc = read_json(os.path.join(rundir, "state.json"))
            if doc and doc.get("role") != "member":
                state = doc
            pump(state.get("attempt") if state else 0, final=True)
            out.write(b"E " + json.dumps(state or {}, separators=(",", ":")).encode() + b"\n")
            out.write(b"X head\n")
            out.flush()
            return 0
        attempt = state.get("attempt") if state else 0
        pump(attempt)
        if state and state.get("state") in FINAL:
            pump(attempt, final=True)
            wait_agent_exit(rundir, 5.0)   # the run has left nothing behind when the stream ends
            out.write(b"X end\n")
            out.flush()
            return 0
        if state and ranks and not to_end:
            mine = [r for r in state.get("ranks", []) if r["rank"] in tails]
            if mine and all(r.get("end") is not None for r in mine) and state.get("state") != "starting":
                pump(attempt, final=True)
                out.write(b"E " + json.dumps(state, separators=(",", ":")).encode() + b"\n")
                out.write(b"X ranks\n")
                out.flush()
                return 0
        if now() - last_beat >= HEARTBEAT:
            last_beat = now()
            out.write(b"H\n")
            out.flush()


def main(argv):
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    cmd = argv[1]
    if cmd == "rank":
        rest = argv[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return cmd_rank(rest)
    if cmd == "start":
        opts = {"--config": None, "--head-port": None}
        it = iter(argv[3:])
        foreground = False
        for a in it:
            if a == "--foreground":
                foreground = True
            elif a in opts:
                opts[a] = next(it)
        return cmd_start(argv[2], foreground, opts["--config"], opts["--head-port"])
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


if __name__ == "__main__":
    sys.exit(main(sys.argv))
