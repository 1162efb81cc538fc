"""The rank wrapper, `agent.py rank -- CMD...`: one rank started by mpirun, msrun or torchrun runs
under it; its pid and its end (exit code or signal) go to files its host's supervisor reads.

It starts once per rank, all of a host's ranks at once (128 of them for a 64-host mpirun on a
lab's 2 cores), so it imports what a bare `python3 -S` has loaded already and little more: os,
sys, time, _signal and `layout` (names); ctypes in the child only (PR_SET_PDEATHSIG), json only
when the run has secrets. No subprocess (its import costs more than the wrapper's own work):
the child is forked and exec'd here, an exec that fails is told back through a pipe, as
subprocess does. Measured (bytecode cached, as on the hosts): ~44 ms of CPU per rank with the
whole supervisor imported, ~16 ms so; a bare `python3 -S` ~7.5 ms.
"""

import os
import sys
import time

from .layout import signal   # _signal: importing enum would be a third of the wrapper's start
from .layout import (ATTEMPT_VAR, DIR_VAR, RANK_DIRS_VAR, RANK_OUTPUT_VAR, SECRETS, SECRETS_VAR, WAKE, attempt_dir,
                     rank_log, read_json, write_atomic)

now = time.time
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


_prctl = []  # type: list  # libc's prctl, once found (_find_prctl); [None] where there is none


def _find_prctl():
    if not _prctl:
        try:
            import ctypes   # ~3 ms of CPU: imported once per process (a rank's child, or the supervisor)
            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError, ImportError):
            _prctl.append(None)
    return _prctl[0]


def set_death_signal(sig):
    """This process gets `sig` when the process that started it dies, whatever kills it (SIGKILL,
    the OOM killer): a supervisor or wrapper that cannot clean up still leaves no rank behind.
    Linux only; elsewhere nothing."""
    prctl = _find_prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig):
    """A preexec_fn for subprocess: set_death_signal(sig) in the child. prctl is looked up here,
    in the parent, once: each child importing ctypes again cost ~3 ms of CPU per process (8 per
    host at 8 ranks a host, started at once by the supervisor)."""
    _find_prctl()
    return lambda: set_death_signal(sig)


def enter_rank_dir(workdir, rank):
    """job.rank_dirs: the rank's own directory, workdir/rank_<N>, holding a link to each top-level
    entry of workdir (the synced code and data), so that the command runs as from workdir while
    what the rank writes at fixed relative paths (checkpoints, ms_log/, kernel_meta/) stays its
    own. Links already there (a restart) are kept. Returns the directory."""
    d = os.path.join(workdir, "rank_%d" % rank)
    try:
        os.mkdir(d)
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


def read_secrets(rundir):
    """The run's secret env values for a rank (`agent.py rank`, mpirun): {} when there are none."""
    path = os.environ.get(SECRETS_VAR) or os.path.join(rundir, SECRETS)
    if not rundir or not os.path.exists(path):   # no secrets: json is not even imported
        return {}
    doc = read_json(path, 1 << 20)
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}


def _child(argv, env, cwd, out, report):
    """In the forked child: become the rank (never returns)."""
    try:
        set_death_signal(signal.SIGKILL)
        # python ignores SIGPIPE and SIGXFSZ; the rank gets the defaults, as subprocess gives them
        for name in ("SIGPIPE", "SIGXFSZ"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        if cwd is not None:
            os.chdir(cwd)
        if out is not None:
            os.dup2(out, 1)
            os.dup2(out, 2)
        keep = {0, 1, 2, report}
        for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
            if fd.isdigit() and int(fd) not in keep:   # what the launcher left open: not the rank's
                try:
                    os.close(int(fd))
                except OSError:
                    pass
        os.execvpe(argv[0], argv, env)
    except BaseException as exc:   # noqa: BLE001 - whatever it is, the parent hears it and the child ends
        try:
            err = getattr(exc, "errno", None) or 0
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            os.write(report, ("%d:%s" % (err, why)).encode("utf-8", "replace")[:512])
        finally:
            os._exit(127)


def start(argv, env, cwd=None, out=None):
    """Fork and exec `argv` (found on env's PATH): its pid, once it runs. OSError (its errno and
    reason) when it cannot be started."""
    if not argv:
        raise OSError(0, "nothing to run")
    r, w = os.pipe()   # both ends close on exec: the parent reads nothing when the exec worked
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(argv, env, cwd, out, w)
    os.close(w)
    try:
        got = b""
        while True:
            part = os.read(r, 512)
            if not part:
                break
            got += part
    finally:
        os.close(r)
    if got:
        os.waitpid(pid, 0)
        err, _, why = got.decode("utf-8", "replace").partition(":")
        raise OSError(int(err) if err.isdigit() else 0, why)
    return pid


def wake(rundir):
    """Tell this host's supervisor a rank's pid or end is written (it reads them at once instead of
    at its next turn): a byte into the run directory's FIFO, never waiting. Nothing when there is
    no supervisor reading (it reads the files on its own then, each second)."""
    try:
        fd = os.open(os.path.join(rundir, WAKE), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.write(fd, b"!")
    except OSError:   # full: the supervisor has a wake-up waiting already
        pass
    finally:
        os.close(fd)


def _number_json(v):
    return "null" if v is None else repr(v)


def run_rank(argv):
    """`agent.py rank -- CMD...`: run one rank under mpirun/msrun/torchrun: its pid and its end
    (exit code or signal) go to files the host's supervisor reads. Signals are passed on to the
    rank; its exit status is passed up. With ORCH_RANK_OUTPUT (torchrun, which keeps no per-rank
    files of its own) the rank's output goes to its log, as mpirun lays it out; with
    ORCH_RANK_DIRS it starts in its own directory (enter_rank_dir); the run's secret env values
    come from the host's supervisor (read_secrets), never from the launcher."""
    rundir = os.environ.get(DIR_VAR, "")
    attempt = os.environ.get(ATTEMPT_VAR, "1")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK_ID") or os.environ.get("RANK") or ""
    adir = attempt_dir(rundir, int(attempt) if attempt.isdigit() else 1)
    out, cwd = None, None
    if rank.isdigit() and os.environ.get(RANK_DIRS_VAR):
        cwd = enter_rank_dir(os.getcwd(), int(rank))
    if rank.isdigit() and rundir and os.environ.get(RANK_OUTPUT_VAR):
        log = rank_log(adir, int(rank), "mpirun")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    env = dict(os.environ)
    env.update(read_secrets(rundir))
    code = sig = None
    try:
        pid = start(argv, env, cwd, out)
    except OSError as exc:
        msg = "orch: cannot start %s: %s\n" % (argv[0] if argv else "(nothing)", exc.strerror)
        os.write(out, msg.encode()) if out is not None else sys.stderr.write(msg)
        code, start_time = 127, now()
    else:
        start_time = now()
        for s in FORWARDED:
            signal.signal(s, lambda n, f: _forward(pid, n))
        if rank.isdigit() and rundir:
            try:
                write_atomic(os.path.join(adir, "rank.%s.pid" % rank),
                             '{"pid": %d, "start": %r}' % (pid, start_time))
                wake(rundir)
            except OSError:
                pass
        _, status = os.waitpid(pid, 0)   # retried after a forwarded signal (PEP 475)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
    if out is not None:
        os.close(out)
    if rank.isdigit() and rundir:
        try:
            write_atomic(os.path.join(adir, "rank.%s.exit" % rank),
                         '{"exit_code": %s, "signal": %s, "start": %r, "end": %r}'
                         % (_number_json(code), _number_json(sig), start_time, now()))
            wake(rundir)
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


def _forward(pid, sig):
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def main(argv):
    """agent.py's entry for `rank` (the stub imports this module alone for it)."""
    rest = argv[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return run_rank(rest)
