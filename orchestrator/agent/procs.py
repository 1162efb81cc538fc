"""This host's processes of a run: start them (as the supervisor's own children, so exit
codes and signals come from waitpid), read what `agent.py rank` reports of the ranks that
mpirun/msrun/torchrun start, follow their output's progress, stop them (TERM, then KILL),
capture their stacks. The rank wrapper itself (`agent.py rank`) is rank.py.

Nothing here forces a umask: the ranks, their logs and checkpoints get the user's own.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from . import jsonc, load, metrics
from .layout import signal
from .layout import (AGENT_VAR, ATTEMPT_DIR_TOKEN, ATTEMPT_VAR, REPLACED_VAR, DIR_VAR, HEAD_ADDR_TOKEN, RANK_DIRS_VAR,
                     PACKAGE, RUN_VAR, SECRETS, SLURM_JOB_VAR, WRAPPING_LAUNCHERS,
                     attempt_dir, find_program, rank_log, read_json, which, write_atomic)
from .rank import die_with_parent, enter_rank_dir
from .states import RankState

now = time.time
KILL_WAIT = 10.0   # after SIGKILL, how long a stop waits for the processes to be gone


def run_pids(run_id, me=None):
    """Every live process of the run on this host but the supervisors (found by its environment)."""
    needle = ("%s=%s" % (RUN_VAR, run_id)).encode()
    agent = (AGENT_VAR + "=1").encode()
    me = os.getpid() if me is None else me
    out: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:   # out of descriptors, say: nothing found this time, asked again next tick
        return out
    for p in entries:
        if not p.isdigit() or int(p) == me:
            continue
        try:
            with open("/proc/%s/environ" % p, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        # the whole environment searched first (in C): split only where the run's id is (every
        # process of the host is read, each load sample: 3.1 -> 1.9 ms at 210 processes)
        if needle in data:
            env = data.split(b"\0")
            if needle in env and agent not in env:
                out.append(int(p))
    return out


def pid_of_run(pid, run_id):
    """Is `pid` alive and a process of this run (its environment carries the run's id)?"""
    try:
        with open("/proc/%d/environ" % int(pid), "rb") as fh:
            return ("%s=%s" % (RUN_VAR, run_id)).encode() in fh.read().split(b"\0")
    except (OSError, ValueError, TypeError):
        return False


def signal_pids(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


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


def pid_runs_python(pid):
    """Is the process `pid` a python interpreter (its executable's name)?"""
    try:
        return os.path.basename(os.readlink("/proc/%d/exe" % pid)).startswith("python")
    except OSError:
        return False


def substitute(value, adir, head_address):
    return value.replace(ATTEMPT_DIR_TOKEN, adir).replace(HEAD_ADDR_TOKEN, head_address or "")


# ---- starting a process that dies with the supervisor
# A rank or launcher gets a death signal (PR_SET_PDEATHSIG), which only the process itself can set
# after its fork. subprocess with a preexec_fn that sets it must fork the supervisor (copying its
# memory map: ~2.6 ms of CPU a process, child and parent, against ~0.5 ms for a vfork), and
# imports subprocess (~5 ms) and ctypes (~3 ms) first. util-linux's setpriv (>= 2.33) sets it and
# execs the command: os.posix_spawn of setpriv (vfork + exec) ~1.4 ms a process, nothing imported.
# Where setpriv lacks --pdeathsig (util-linux < 2.33: CentOS 7, Ubuntu 18.04) or is missing, the
# fork stays. At 128 hosts x 8 ranks on a lab's 2 cores: ~2 CPU-s of the ranks' start.
DEATH_SIGNALS = {signal.SIGKILL: "KILL", signal.SIGTERM: "TERM"}
SETPRIV_TRY_WAIT = 2.0   # the one try of setpriv (its --version): longer, and it is not used
_setpriv = []  # type: list  # [setpriv's path] once tried and able to give a death signal; [None]: not here


def death_setpriv(home=None):
    """The path of this host's setpriv when it starts a process with a death signal, in a session
    of its own; None when it does not (then fork, as before). Tried once per supervisor, one exec:
    `setpriv --pdeathsig KILL --version` (setpriv reads its options in order: one that lacks the
    option stops at it, exit 1; one that has it prints its version, exit 0), posix_spawn'ed with
    setsid as spawn_dying starts a rank. Called before the supervisor's SIGCHLD handler is
    installed (Local()), which would reap the try. `home`: where a yes is kept (kept_setpriv)."""
    if not _setpriv:
        _setpriv.append(kept_setpriv(which("setpriv"), home))
    return _setpriv[0]


def package_home():
    """The directory of the agent package a supervisor runs from (<workdir>/.orch/agent-<hash>,
    made the user's alone by its start); None where this is not that package (orch's own tree)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__))) if __package__ == PACKAGE else None


def kept_setpriv(path, home):
    """_try_setpriv's answer, a yes kept in `home` for this very setpriv (its device, inode, size
    and modification time in the name of an empty file): a host's later supervisors take it
    without the exec (~1.3 ms of CPU, and its wait, in every member's start). Only a directory
    of the user's that no one else may write, and a regular file of the user's in it, are trusted;
    a no (or a try that timed out) is not kept: the next supervisor tries again."""
    mark = _setpriv_mark(path, home)
    try:
        k = os.lstat(mark) if mark else None
        if k is not None and stat.S_ISREG(k.st_mode) and k.st_uid == os.geteuid():
            return path
    except OSError:
        pass
    got = _try_setpriv(path)
    if got is not None and mark:
        try:
            os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except OSError:   # kept already (another start), or not writable: tried again next time
            pass
    return got


def _setpriv_mark(path, home):
    """Where kept_setpriv keeps a yes for setpriv `path`; None where nothing is kept (no setpriv,
    no home, or a home that is not a directory of the user's alone)."""
    if path is None or not home:
        return None
    try:
        d, st = os.lstat(home), os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(d.st_mode) or d.st_uid != os.geteuid() or d.st_mode & 0o022:
        return None
    return os.path.join(home, "setpriv-%d-%d-%d-%d.yes" % (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _try_setpriv(path):
    if path is None or not hasattr(os, "posix_spawn"):
        return None
    null = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    # its end is ours to wait for: not reaped by a handler, not discarded (SIGCHLD ignored, inherited)
    try:
        old = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:   # not the main thread (a test's): as it is
        old = None
    try:
        pid = os.posix_spawn(path, [path, "--pdeathsig", "KILL", "--version"], {"PATH": os.defpath},
                             file_actions=null, setsid=True)
        deadline = now() + SETPRIV_TRY_WAIT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return path if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else None
            if now() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.002)
    except (OSError, NotImplementedError, TypeError, ValueError):   # no setsid in this libc's posix_spawn...
        return None
    finally:
        if old is not None:
            signal.signal(signal.SIGCHLD, old)


def spawn_dying(setpriv, argv, cwd, env, fd, sig):
    """Start argv in cwd with env, stdin /dev/null, stdout and stderr on fd, in a session of its
    own, to get `sig` when this process dies: what subprocess.Popen(start_new_session=True,
    close_fds=True, preexec_fn=die_with_parent(sig)) does, by setpriv. Its pid; None when setpriv
    would not run it as Popen's exec does (direct_exec): then the caller starts it so. Raises
    OSError as Popen would: a program not found on env's PATH, not executable, or a script whose
    interpreter is (else setpriv would say so in the rank's log, not orch)."""
    try:   # the supervisor's own directory, to come back to (O_PATH: one it may not read)
        here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_PATH", 0))
    except OSError:
        here = None
    try:
        os.chdir(cwd)   # posix_spawn has no cwd; the supervisor has one thread
        found, err = find_program(argv[0], env.get("PATH", os.defpath))
        if found is None:
            raise OSError(err, os.strerror(err), argv[0])
        if not direct_exec(found, argv[0]):
            return None
        # Popen's close_fds: every descriptor of ours is close-on-exec (PEP 446) but any left
        # inheritable (a caller's), closed in the child; SIGPIPE and SIGXFSZ, which python
        # ignores, back to their default (Popen's restore_signals)
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, fd, 1),
                   (os.POSIX_SPAWN_DUP2, fd, 2)] + [(os.POSIX_SPAWN_CLOSE, x) for x in inheritable_fds() if x != fd]
        return os.posix_spawn(setpriv, [setpriv, "--pdeathsig", DEATH_SIGNALS[sig], "--"] + list(argv), env,
                              file_actions=actions, setsid=True, setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
    finally:
        if here is None:
            os.chdir("/")
        else:
            os.fchdir(here)
            os.close(here)


def direct_exec(path, name):
    """Does setpriv's exec of `path` (execvp) do what Popen's execve does? For an ELF program, and
    for a script ("#!") whose interpreter is there (OSError, as the execve's, naming the program
    `name`, when it is missing or not executable). Anything else (no "#!", not ELF: execvp hands it
    to /bin/sh where execve fails, "Exec format error"; a format of binfmt_misc; a file it cannot
    read) is not: False."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(256)   # the kernel reads no more of a "#!" line (BINPRM_BUF_SIZE)
    except OSError:
        return False
    if head.startswith(b"\x7fELF"):
        return True
    if not head.startswith(b"#!"):
        return False
    words = head[2:].split(b"\n", 1)[0].split()
    if not words:
        return False
    interpreter = os.fsdecode(words[0])
    if not os.path.exists(interpreter):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    if not os.access(interpreter, os.X_OK) or os.path.isdir(interpreter):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), name)
    return True


def inheritable_fds():
    """This process's descriptors above 2 that a process it starts would inherit."""
    out: list[int] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:   # the listing's own descriptor, closed by now
            pass
    return out


class Local:
    """This host's part of the run: the processes the supervisor starts, the ranks mpirun or
    msrun start (wrapped by `agent.py rank`), their states, stopping them, their output's
    progress. report() is what a member sends the head (protocol.parse_report checks it)."""

    def __init__(self, cfg, note):
        self.cfg = cfg
        self.note = note
        self.run_id = cfg["run_id"]
        self.rundir = cfg["rundir"]
        self.host = cfg["host"]
        self.launcher = cfg["launcher"]
        self.attempt = 0
        self.head_address = ""
        self.children = {}        # pid -> its process record (of whichever attempt started it)
        self.procs = {}           # key -> record
        self.ranks = {}           # rank -> record
        self.stopping = None      # [reason, deadline, killed]
        self.left = False         # a stop goes on and processes of the run live here (stop_tick: live())
        self.alive = False        # what stop_tick's look found (left, but for the KILL it gave up on)
        self.last_output = 0.0
        self.sizes = {}
        self.logs = {}            # rank -> its log's path, once there (watch_output: rank_log's look each poll saved)
        self.grew = False         # the last poll found a rank's output grown (the loop turns quickly then)
        self.changed = True
        self.stop_state = RankState.STOPPED   # what a rank that our stop ended is: stopped (or lost)
        self.secrets_path = None
        self.replaced = ""         # "old->new,...": the hosts replaced by spares so far
        self.start_error = ""      # why this attempt's processes cannot start here (a launch file unwritten)
        self.exits = []           # (pid, status, when) of children reaped, as they ended (collect)
        # parse_output: off only in tests/benchmarks/bench_progress.py (the cost of parsing, measured)
        self.progress = metrics.Progress(cfg.get("metrics"), note, cfg.get("parse_output", True))
        self.load = load.Sampler(self.run_id, self.rundir, run_pids, note)
        # how this host starts its processes (tried now: before the SIGCHLD handler; not where none start)
        self.setpriv = None
        if cfg.get("procs") or cfg.get("slot_procs"):
            self.setpriv = death_setpriv(package_home())
            note("processes start %s" % ("through %s --pdeathsig" % self.setpriv if self.setpriv else
                                          "by fork (no setpriv with --pdeathsig here)"))

    # ---- starting
    def start(self, attempt, head_address="", slot=None, files=None, replaced=""):
        """Start this host's part of an attempt. `slot`: this host is a spare taking that host's
        place (its ranks and processes, as the controller rendered them for this host: cfg
        slot_procs); `files`: launch files the head rendered for the attempt's host set, written
        into the workdir first; `replaced`: the hosts replaced so far (ORCH_REPLACED_HOSTS)."""
        if slot:
            assigned = (self.cfg.get("slot_procs") or {}).get(slot)
            if assigned is None:
                raise ValueError("asked to take %s's place, which this spare was not prepared for" % slot)
            self.cfg = dict(self.cfg, ranks=assigned["ranks"], procs=assigned["procs"])
        self.replaced = replaced or ""
        # a launch file that cannot be written fails this host's processes, saying why (their ranks
        # would otherwise start on the old file, which names the lost host, and hang)
        self.start_error = "; ".join(filter(None, (self.write_launch_file(n, t) for n, t in sorted((files or {}).items()))))
        self.attempt = attempt
        self.head_address = head_address
        self.stopping = None
        self.stop_state = RankState.STOPPED
        adir = attempt_dir(self.rundir, attempt)
        try:
            os.makedirs(adir, exist_ok=True)
        except OSError as exc:   # every process below then fails to open its log (126), reported as such
            self.note("cannot make %s: %s" % (adir, exc))
        self.flip_log_link(adir)
        self.last_output = now()
        self.sizes = {}
        self.logs = {}
        self.progress.reset([r["rank"] for r in self.cfg["ranks"]])
        self.ranks = {}
        for r in self.cfg["ranks"]:
            self.ranks[r["rank"]] = {"rank": r["rank"], "host": self.host, "device": r["device"], "pid": None,
                                     "state": RankState.PENDING, "exit_code": None, "signal": None,
                                     "start": None, "end": None, "attempt": attempt}
        self.procs = {}
        for p in self.cfg["procs"]:
            self.spawn(p, attempt, adir)
        self.load.begin(now())
        self.changed = True

    def write_launch_file(self, name, text):
        """A hostfile or rank table the head rendered: only a name this run writes (cfg
        launch_files), into the workdir, atomically and the user's alone. Returns why it could
        not be written ("" when it was, or when it is no file of this run: noted, not written)."""
        if name not in (self.cfg.get("launch_files") or ()):
            self.note("not writing %r: not a launch file of this run" % name[:64])
            return ""
        path = os.path.join(self.cfg["workdir"], name)
        try:
            write_atomic(path, text, 0o600)
        except OSError as exc:
            self.note("cannot write %s: %s" % (path, exc))
            return "cannot write %s for this attempt's host set: %s" % (path, exc.strerror or exc)
        return ""

    def write_secrets(self):
        """The run's secret env values for `agent.py rank` on this host (mpirun: never on Open MPI's
        wire), in a file only the user can read, in a run directory only the user can enter; written
        before the supervisor joins (so before any rank can start), removed when it exits."""
        secrets = self.cfg.get("secret_env") or {}
        if not secrets or self.launcher not in WRAPPING_LAUNCHERS:
            return
        self.secrets_path = os.path.join(self.rundir, SECRETS)
        try:
            write_atomic(self.secrets_path, jsonc.dumps(secrets), 0o600)
        except OSError as exc:
            self.note("cannot write the ranks' secret environment: %s" % exc)

    def drop_secrets(self):
        if self.secrets_path:
            try:
                os.unlink(self.secrets_path)
            except OSError:
                pass
            self.secrets_path = None

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

    def spawn(self, p, attempt, adir):
        rec = {"key": p["key"], "rank": p.get("rank"), "pid": None, "exit_code": None, "signal": None,
               "start": now(), "end": None}
        self.procs[p["key"]] = rec
        log = os.path.join(adir, p["log"])
        env = dict(os.environ)
        env.pop(AGENT_VAR, None)
        if SLURM_JOB_VAR in env:  # a Slurm job step: the processes see the whole allocation again
            env.update(jsonc.loads(env.pop(SLURM_JOB_VAR)))
            env.setdefault("OMPI_MCA_plm_slurm_args", "--overlap")  # mpirun's orteds share our nodes
        env.update({k: substitute(v, adir, self.head_address) for k, v in p["env"].items()})
        # the hosts replaced by spares so far ("" when none): mpirun passes it on to its ranks (-x)
        env.update({RUN_VAR: self.run_id, DIR_VAR: self.rundir, ATTEMPT_VAR: str(attempt), REPLACED_VAR: self.replaced})
        rank = p.get("rank")
        try:
            os.makedirs(os.path.dirname(log), exist_ok=True)
            if p.get("env_log"):  # seed 001 keeps each rank's environment beside its log
                write_atomic(os.path.join(os.path.dirname(log), "env.log"),
                             "".join("%s=%s\n" % kv for kv in sorted(env.items())), 0o600)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
        except OSError as exc:
            self.note("cannot open %s: %s" % (log, exc))
            self.ended(rec, 126, None)
            return
        if self.start_error:
            os.write(fd, ("orch: %s\n" % self.start_error).encode())
            os.close(fd)
            self.ended(rec, 126, None)
            return
        try:
            cwd = p["cwd"]
            if rank is not None and env.get(RANK_DIRS_VAR):
                cwd = enter_rank_dir(cwd, rank)
            argv = [substitute(a, adir, self.head_address) for a in p["argv"]]
            # a rank dies with its supervisor; a launcher (mpirun, msrun, torchrun) is told to stop,
            # which it passes on to its ranks
            sig = signal.SIGKILL if rank is not None else signal.SIGTERM
            pid = spawn_dying(self.setpriv, argv, cwd, env, fd, sig) if self.setpriv else None
            if pid is None:
                import subprocess   # here: ~5 ms of a supervisor's start (most start nothing: mpirun's members)
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                        preexec_fn=die_with_parent(sig))
                proc.returncode = 0   # we reap it ourselves (waitpid); keep Popen from doing it too
                pid = proc.pid
        except OSError as exc:
            os.write(fd, ("orch: cannot start %s: %s\n" % (p["argv"][0], exc.strerror)).encode())
            os.close(fd)
            self.ended(rec, 127, None)
            return
        os.close(fd)
        rec["pid"] = pid
        self.children[pid] = rec
        if rank is not None:
            self.ranks[rank].update(pid=pid, state=RankState.RUNNING, start=rec["start"])

    # ---- watching
    def poll(self):
        """Reap children, read wrapped ranks' reports, follow output. True when something changed."""
        self.reap()
        if self.launcher in WRAPPING_LAUNCHERS:
            self.read_wrapped()
        self.watch_output()
        self.load.tick(now())
        changed, self.changed = self.changed, False
        return changed

    def ended(self, rec: dict, code, sig, when=None):
        rec.update(exit_code=code, signal=sig, end=now() if when is None else when)
        self.changed = True
        if rec.get("rank") is not None and self.procs.get(rec["key"]) is rec:
            self.rank_ended(rec["rank"], code, sig, rec["end"])

    def rank_ended(self, rank, code, sig, when):
        r = self.ranks.get(rank)
        if r is None or r["end"] is not None:
            return
        if self.stopping is not None and (code != 0 or sig):
            state = self.stop_state
        else:
            state = RankState.EXITED if code == 0 and not sig else RankState.FAILED
        r.update(exit_code=code, signal=sig, end=when, state=state)
        self.changed = True

    def read_wrapped(self):
        adir = attempt_dir(self.rundir, self.attempt)
        for rank, r in self.ranks.items():
            if r["end"] is not None:
                continue
            if r["pid"] is None:
                pid = read_json(os.path.join(adir, "rank.%d.pid" % rank), 4096)
                if isinstance(pid, dict) and isinstance(pid.get("pid"), int):
                    r.update(pid=pid["pid"], start=_number(pid.get("start")), state=RankState.RUNNING)
                    self.changed = True
            ex = read_json(os.path.join(adir, "rank.%d.exit" % rank), 4096)
            if isinstance(ex, dict):
                code, sig = ex.get("exit_code"), ex.get("signal")
                self.rank_ended(rank, code if isinstance(code, int) else None, sig if isinstance(sig, int) else None,
                                _number(ex.get("end")) or now())

    def watch_output(self):
        """Each rank's log: when it last grew, and what it grew by (progress). `grew`: some did."""
        adir = attempt_dir(self.rundir, self.attempt)
        self.grew = False
        for rank in self.ranks:
            path = self.logs.get(rank) or rank_log(adir, rank, self.launcher)
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            self.logs[rank] = path   # there: where it stays for the attempt (no second stat, no listing)
            if size != self.sizes.get(rank):
                self.sizes[rank] = size
                self.last_output = now()
                self.grew = True
                self.progress.read(rank, path, size, self.last_output)

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
        self.left = self.signal_all(signal.SIGTERM)   # stop_tick looks again each turn
        self.changed = True

    def restop(self, reason, grace):
        """Stop again, whatever a previous stop did (the head's end of an attempt)."""
        self.stopping = None
        self.stop(reason, grace)

    def signal_all(self, sig):
        """`sig` to every process of the run here; whether there was any."""
        for pid in list(self.children):
            try:
                os.killpg(pid, sig)
            except OSError:
                pass
        pids = run_pids(self.run_id)
        signal_pids(pids, sig)
        return bool(self.children) or bool(pids)

    def stop_tick(self):
        """Advance a stop: KILL what outlived the grace period. True once nothing of the run lives."""
        if self.stopping is None:
            return False
        self.left = self.alive = self.live()
        if not self.left:
            self.finish_pending(self.stop_state)
            return True
        if now() > self.stopping[1] and not self.stopping[2]:
            self.stopping[2] = True
            self.signal_all(signal.SIGKILL)
        elif self.stopping[2] and now() > self.stopping[1] + KILL_WAIT:
            # KILLed and still there (uninterruptible I/O, a stuck NFS mount): say so, stop waiting
            self.note("processes of the run still alive %gs after SIGKILL: %s" % (KILL_WAIT, run_pids(self.run_id)))
            self.finish_pending(self.stop_state)
            self.children.clear()
            self.left = False     # said; the head no longer waits for them
            return True
        return False

    def kill_now(self, grace):
        """The supervisor is going down (a crash): TERM everything of the run here, wait up to
        `grace` seconds, KILL what is left. Bounded; raises nothing."""
        try:
            if self.stopping is None:   # what ends now was stopped by us, not failed
                self.stopping = ["the run's supervisor crashed", now() + grace, False]
            self.signal_all(signal.SIGTERM)
            deadline = now() + grace
            while now() < deadline and self.live():
                self.reap()
                time.sleep(0.1)
            if self.live():
                self.signal_all(signal.SIGKILL)
                time.sleep(0.2)
            self.reap()
            self.finish_pending(self.stop_state)
        except Exception as exc:  # noqa: BLE001 - the last thing a dying supervisor does
            self.note("while stopping this host's ranks: %r" % exc)
        self.drop_secrets()

    def collect(self, *signal_args):
        """Reap what has ended, noting when: the supervisor's SIGCHLD handler (so a rank's end is
        the moment it ended, not the next turn of the loop: the first failure across hosts is
        told by these times), and reap() itself."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exits.append((pid, status, now()))

    def reap(self):
        """Every child that has ended: its exit code or signal, from waitpid, and when it ended."""
        self.collect()
        exits, self.exits = self.exits, []
        for pid, status, when in exits:
            rec = self.children.pop(pid, None)
            if rec is not None:   # a late one of an earlier attempt updates its own record only
                self.ended(rec, os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                           os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, when)
            elif now() - when < 60:   # collected before spawn() recorded it (or not ours): kept a while
                self.exits.append((pid, status, when))

    def finish_pending(self, state):
        for r in self.pending_ranks():
            r.update(state=state, end=now())
            self.changed = True

    def dump_stacks(self):
        """A stalled run: each rank's Python stack, with py-spy when the host has it, else
        SIGABRT, which makes a rank started with PYTHONFAULTHANDLER=1 print every thread's stack
        into its own log before it ends."""
        adir = attempt_dir(self.rundir, self.attempt)
        spy = which("py-spy")
        for rank, r in sorted(self.ranks.items()):
            pid = r.get("pid")
            if not pid or r["end"] is not None:
                continue
            if spy:   # started, not waited for: the loop goes on (reap() collects it)
                out = os.path.join(os.path.dirname(rank_log(adir, rank, self.launcher)), "stacks.txt")
                try:
                    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
                    try:
                        import subprocess   # here: see start()
                        subprocess.Popen(["timeout", "20", spy, "dump", "--pid", str(pid)], stdin=subprocess.DEVNULL,
                                         stdout=fd, stderr=subprocess.STDOUT, close_fds=True).returncode = 0
                    finally:
                        os.close(fd)
                    continue
                except OSError:
                    pass
            for p in [pid] + children_of(pid):
                if pid_runs_python(p):
                    signal_pids([p], signal.SIGABRT)

    def report(self):
        # live: what the head waits for before it ends an attempt. While a stop goes on, any process
        # of the run here counts (self.left, from stop_tick's own look each turn): a launcher's
        # worker it left behind as it died on TERM is no child of ours and no rank of our own, but
        # the stop KILLs it after the grace
        live = bool(self.children) or bool(self.pending_ranks()) or (self.stopping is not None and self.left)
        return {"host": self.host, "attempt": self.attempt, "ranks": [dict(r) for r in self.ranks.values()],
                "procs": [dict(p) for p in self.procs.values()], "out": self.last_output,
                "stopping": self.stopping[0] if self.stopping else None,
                "live": live, "progress": self.progress.report(now()), "load": self.load.sample}


def _number(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
