"""Names: the environment variables, files and directories of a run on a host.

The controller (orchestrator.launchers, supervisor, logs, ...) and the supervisor on the hosts
both read these; nothing here does I/O but the small helpers at the end.
"""

import errno
import os
import sys

# signal for every module here (rank, procs, server, states import it from here): CPython's C
# module, as `signal` imports enum (~3.3 ms of CPU at every start of a supervisor on every host)
try:
    import _signal as signal  # type: ignore[import-not-found]  # no stub; re-exported
except ImportError:   # pragma: no cover - another Python
    import signal  # noqa: F401 - re-exported

# typing's name for it, which mypy reads as True: the modules import typing for mypy alone (`if
# TYPE_CHECKING:`); at run time its import is ~5 ms of every supervisor's start on every host
TYPE_CHECKING = False

# environment
RUN_VAR = "ORCH_RUN_ID"          # every process of a run carries it (orch down's sweep finds them by it)
AGENT_VAR = "ORCH_AGENT"         # set in supervisors' own environment only: sweeps spare agents
DIR_VAR = "ORCH_RUN_DIR"
ATTEMPT_VAR = "ORCH_ATTEMPT"
REPLACED_VAR = "ORCH_REPLACED_HOSTS"   # "old->new,...": hosts a spare took the place of, so far
RANK_DIRS_VAR = "ORCH_RANK_DIRS"      # job.rank_dirs: each rank starts in workdir/rank_<N>
RANK_OUTPUT_VAR = "ORCH_RANK_OUTPUT"  # `agent.py rank` writes the rank's output to its log itself
SECRETS_VAR = "ORCH_SECRETS"          # `agent.py rank`: the file with the run's secret env values
SLURM_JOB_VAR = "ORCH_SLURM_JOB"
SLURM_JOB_KEYS = ("SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                  "SLURM_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_CPUS_PER_NODE")

# tokens in a process's argv or env values, replaced by the host's supervisor at start
ATTEMPT_DIR_TOKEN = "@ORCH_ATTEMPT_DIR@"   # this attempt's directory
HEAD_ADDR_TOKEN = "@ORCH_HEAD_ADDR@"       # the launch host's address as the other hosts reach it

WRAPPING_LAUNCHERS = ("mpirun", "msrun", "torchrun")  # their ranks run under `agent.py rank`

# files and directories
ORCH_DIR = ".orch"          # in a workdir: one directory per run, the lock, Slurm's go files (0700)
LOCK = "lock"               # ORCH_DIR's file a run's supervisor holds locked for the run's life (0600)
PACKAGE = "orch_agent"      # this package, as copied into <workdir>/.orch/agent-<hash>/
AGENT = "agent.py"          # the stub the hosts run (one per run): imports PACKAGE from the workdir's copy
STATE = "state.json"        # this host's view of the run (the head's: the run's)
INFO = "agent.json"         # how local clients (watch, stop) reach the head: address, port, token (0600)
AGENT_LOG = "agent.log"
SECRETS = "secrets.json"    # the run's secret env values for `agent.py rank` (0600, removed at the end)
WAKE = "wake"               # a FIFO (0600): `agent.py rank` writes a byte to it once it wrote a rank's pid or end
CONFIG = "config.{node}.json"  # a Slurm job step's supervisor configuration (0600, removed once read)
# seconds a supervisor's start waits on a silent stdin for what it is still to be told (its
# configuration, the head's port): while the controller waits (the sync, the head's start), it
# sends a blank line every START_SILENCE / 6 s; silent that long, whoever would tell it is gone
START_SILENCE = 60


def orch_dir(workdir):
    return os.path.join(workdir, ORCH_DIR)


def lock_path(workdir):
    return os.path.join(workdir, ORCH_DIR, LOCK)


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


def write_atomic(path, text, mode=0o600):
    """Write a file under its real name only once complete; never through a planted link.
    `mode` is filtered by the user's umask, as any file the user makes."""
    tmp = "%s.%d.%s.tmp" % (path, os.getpid(), os.urandom(4).hex())
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


def leave(code):
    """sys.exit(code), without python's teardown of the modules: stdout and stderr flushed, then
    os._exit. agent.py's entry (the run's stub, the start's boot) ends so: the teardown is ~3 ms of
    CPU on every start of a supervisor and every agent call on every host (an mpirun rank's
    wrapper too), and the agent leaves nothing to it (its files are written and closed by then;
    it has no atexit work)."""
    if code is None:
        code = 0
    elif not isinstance(code, int):   # sys.exit's way with a message
        sys.stderr.write("%s\n" % code)
        code = 1
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):   # a reader gone (python's own exit says so with 120); closed
            code = code or 120
    os._exit(code)


_COMPILED = {}  # type: dict


def compiled(pattern):
    """A regular expression of the agent's (str or bytes), compiled (MULTILINE) at its first use:
    `re` is imported then, not at every supervisor's start (re imports enum: ~4 ms of CPU with
    the compiling, on every host, for output that may never hold a progress line, on a host
    that may have no device to read)."""
    rx = _COMPILED.get(pattern)
    if rx is None:
        import re
        rx = _COMPILED[pattern] = re.compile(pattern, re.MULTILINE)
    return rx


def read_json(path, limit=64 << 20):
    """A JSON document from a file (None when missing, unreadable, too large or not JSON)."""
    from . import jsonc   # lazy: the rank wrapper (rank.py) imports this module, and reads no JSON without secrets
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            return None
        return jsonc.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def which(name):
    """shutil.which(name) for a bare name: the executable file of that name on PATH, or None.
    (Importing shutil loads bz2, lzma and fnmatch: ~3 ms of every supervisor's start, on every
    host, for this alone.)"""
    return find_program(name)[0]


def find_program(name, search=None):
    """Where an exec by name (execvp) finds `name`: (its path, 0), or (None, the errno the exec
    fails with). A name with a "/" is that file; a bare name is searched on `search` (a PATH
    value; this process's PATH when None): EACCES when a file of that name was there but not
    executable (or a directory), as execvp says, else ENOENT."""
    if "/" in name:
        if not os.path.exists(name):
            return None, errno.ENOENT
        return (name, 0) if os.access(name, os.X_OK) and not os.path.isdir(name) else (None, errno.EACCES)
    err = errno.ENOENT
    for d in (os.environ.get("PATH", os.defpath) if search is None else search).split(os.pathsep):
        path = os.path.join(d or os.curdir, name)
        if os.path.exists(path):
            if os.access(path, os.X_OK) and not os.path.isdir(path):
                return path, 0
            err = errno.EACCES
    return None, err
