"""The controller's side of the run supervisor (orchestrator/agent, which runs on the hosts).

Pure: the supervisors' configurations, the shell scripts that ship the agent package and
start and query it, and the parser of the event stream `agent.py watch` writes. The
transport runs the scripts.
"""

from __future__ import annotations

import base64
import json
import posixpath
import secrets
import shlex
import threading
import time
import zlib
from dataclasses import dataclass
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from .. import __version__, sh
from ..agent import delta, layout
from ..agent.layout import AGENT, DIR_VAR, RUN_VAR
from ..hostlayout import PY, orch_dir, run_dir
from ..launchers import HeadReach, Launch, head_reach
from ..rankplan import RankPlan
from ..model import Cluster
from ..transport import Transport

STOP_GRACE = 5.0
LOST_AFTER_MIN = 10.0   # seconds a supervisor may stay silent before its host counts as lost
JOIN_TIMEOUT = 60.0
START_TIMEOUT = 2 * JOIN_TIMEOUT  # Slurm: from the go file to the head's supervisor running
MIN_PYTHON = (3, 8)  # agent.py runs on the hosts' python3 (the non-interactive ssh PATH's), stdlib only


AGENT_PACKAGE = Path(__file__).resolve().parent.parent / "agent"
_T = TypeVar("_T")


@lru_cache(maxsize=1)
def agent_sources() -> dict[str, str]:
    """{module file name: source} of the agent package, as the hosts get it."""
    return {p.name: p.read_text() for p in sorted(AGENT_PACKAGE.glob("*.py"))}


def batch_grace(cluster: Cluster) -> float:
    """Slurm: how long the batch script waits for the members' step once the head's has ended
    (and so how long orch waits for the job to end by itself before cancelling it)."""
    return lost_after(cluster) + STOP_GRACE + 30


def lost_after(cluster: Cluster) -> float:
    """How long a silent supervisor (or the controller's watch stream) is waited for:
    max(10 s, 2 x connect_timeout)."""
    return max(LOST_AFTER_MIN, 2 * cluster.ssh.connect_timeout)


def head_address(cluster: Cluster, plan: RankPlan, launch: Launch | None = None) -> HeadReach:
    """Where the other hosts reach the head: as the launch was built (launch.head), else by
    launchers.head_reach's one rule (job.interface's address unknown)."""
    return (launch.head if launch is not None else None) or head_reach(cluster, plan.launch_host, plan.all_hosts)


def configs(cluster: Cluster, plan: RankPlan, run_id: str, launch: Launch) -> dict[str, dict]:
    """{host name: the supervisor's configuration} (the head's is the launch host's). head_addresses:
    where members try the head, in order (lifecycle puts the head's own list in before starting
    them); head_pinned: that list is the cluster file's one address (the head adds none)."""
    job = cluster.job
    at = head_address(cluster, plan, launch)
    rdir = run_dir(cluster, run_id)
    token = secrets.token_hex(16)
    all_ranks = [{"rank": r.rank, "host": r.host, "device": r.device_id, "pid": None, "state": "pending",
                  "exit_code": None, "signal": None, "start": None, "end": None, "attempt": 0}
                 for r in plan.ranks]
    spares = launch.spares
    files = [n for k, n in (spares.tables if spares else {}).items() if k in ("hostfile", "rank_table")]
    out = {}
    for h in plan.all_hosts:
        head = h.name == plan.launch_host.name
        out[h.name] = {
            "run_id": run_id, "host": h.name, "role": "head" if head else "member", "token": token,
            "orch_version": __version__,
            "head_address": at.addresses[0], "head_addresses": list(at.addresses), "head_pinned": at.pinned,
            "head_port": None,
            "rundir": rdir, "workdir": job.workdir,
            "log_link": f"{job.workdir.rstrip('/')}/{job.log_dir}".replace("//", "/"),
            "launcher": job.launcher, "on_failure": job.on_failure, "restarts": job.restarts,
            "restart_delay": job.restart_delay, "stall_timeout": job.stall_timeout, "timeout": job.timeout,
            "grace": STOP_GRACE, "lost_after": lost_after(cluster), "join_timeout": JOIN_TIMEOUT,
            "ranks": [] if h.spare else [{"rank": r.rank, "device": r.device_id} for r in plan.by_host(h.name)],
            "procs": [p.to_config() for p in launch.procs.get(h.name, ())],
            "secret_env": dict(launch.secret_env.get(h.name, {})),
            "metrics": dict(job.metrics),
            **({"hosts": [x.name for x in plan.hosts], "all_ranks": all_ranks} if head else {}),
        }
        if spares is not None:
            out[h.name]["launch_files"] = files
            if head:
                out[h.name].update(spares=[x.name for x in plan.spares], spare_fits=spares.fits(),
                                   tables=dict(spares.tables), servers=list(spares.servers),
                                   spare_servers=list(spares.spare_servers))
            if h.spare:
                out[h.name]["slot_procs"] = {
                    slot: {"ranks": [{"rank": r.rank, "device": r.device_id} for r in plan.by_host(slot)],
                           "procs": [p.to_config() for p in procs]}
                    for slot, procs in spares.slot_procs.get(h.name, {}).items()}
    return out


# The agent package lives once per version in the workdir, <workdir>/.orch/agent-<hash>/orch_agent/
# (content-addressed: the hash of what is shipped), shared by every run started from it: python
# caches its bytecode there (orch_agent/__pycache__), so only the first start of a version on a
# host compiles it (a start: ~50 ms of CPU, ~90 ms when it compiles). Each
# run's directory holds agent.py, a stub importing the package from there (every command on
# the hosts runs `python3 -S <rundir>/agent.py ...`: rank wrappers, status, watch, stop). A rank's
# wrapper imports rank.py alone, not the whole supervisor (~16 ms of CPU per rank instead of ~44:
# mpirun starts them all at once).
AGENT_MODULE = layout.PACKAGE


def _once(fn: Callable[[], _T]) -> Callable[[], _T]:
    """`fn`'s value, computed by its first caller while any other thread that asks at the same
    time waits for it. Every probe of a check asks for agent_home_name as its fan-out thread
    starts, and hashlib and zlib let go of the GIL: with lru_cache alone, every thread that came
    before the first answer computed it again (a 32-host check compressed the package 31 times,
    ~0.45 s of the controller's CPU)."""
    cached, lock = lru_cache(maxsize=1)(fn), threading.Lock()

    @wraps(fn)
    def once() -> _T:
        with lock:
            return cached()
    once.cache_clear = cached.cache_clear  # type: ignore[attr-defined]  # (tests)
    return once


@_once
def _agent_json() -> bytes:
    """The agent package as agent_blob() packs it, uncompressed: {file name: source} as JSON."""
    return json.dumps(agent_sources(), separators=(",", ":")).encode()


@_once
def agent_home_name() -> str:
    """The package's directory name under <workdir>/.orch: agent-<the first 16 hex digits of
    the SHA-256 of the package's sources (_agent_json)>. A check, which only looks for the
    directory, never compresses the package."""
    import hashlib

    return "agent-" + hashlib.sha256(_agent_json()).hexdigest()[:16]


def _home_in(orch: str) -> str:
    """The package's directory in orch's directory of a workdir (<workdir>/.orch)."""
    return posixpath.join(orch, agent_home_name())


def agent_stub(home: str) -> str:
    """agent.py of a run: the package from `home` (<workdir>/.orch/agent-<hash>), then its main."""
    return (f"import sys\nsys.path.insert(0, {home!r})\n"
            f"from {AGENT_MODULE}.layout import leave\n"
            f"if sys.argv[1:2] == ['rank']:\n    from {AGENT_MODULE}.rank import main\n"
            f"else:\n    from {AGENT_MODULE}.cli import main\nleave(main(sys.argv))\n")


# The package travels compressed (base64 of zlib of {file name: source}, one line on stdin) and is
# unpacked by the host's python3 (a script goes to the host as one `sh -c` argument, which Linux
# caps at 128 KiB, MAX_ARG_STRLEN; the sources alone are more than that) into a new directory
# renamed into place: the package's directory exists whole or not at all, whoever wins a race
# (two runs starting at once, hosts sharing the workdir). When it exists, the line is skipped.
# `_BOOT_PY HOME RUNDIR STUB [start [OPTIONS]]`: first the run's directories, each the user's alone (0700;
# never through a planted link, never one another user owns: what the start's shell did with six
# processes, mkdir, chmod and cat, ~6 ms of CPU per host), the run's agent.py (STUB), the package;
# with `start`, the same process goes on to start the supervisor (its configuration: the rest of
# stdin), one python start a host.
_BOOT_PY = ("import os,sys,stat\n"
            "h,r,stub=sys.argv[1:4]\nb=os.path.dirname(r)\n"
            "try:\n os.makedirs(os.path.dirname(b) or '/',exist_ok=True)\n"
            "except OSError as e:\n sys.exit('orch: cannot make %s: %s'%(os.path.dirname(b),e.strerror))\n"
            "for d in (b,r):\n"
            " try:\n  os.mkdir(d,0o700)\n except FileExistsError:\n  pass\n"
            " except OSError as e:\n  sys.exit('orch: cannot make %s: %s'%(d,e.strerror))\n"
            " s=os.lstat(d)\n"
            " if not stat.S_ISDIR(s.st_mode) or s.st_uid!=os.getuid():\n"
            "  sys.exit('orch: %s is not a directory of this user (a link, or another user owns it)'%d)\n"
            " if stat.S_IMODE(s.st_mode)!=0o700:\n  os.chmod(d,0o700)\n"
            f"a=os.path.join(r,{AGENT!r})\n"
            "try:\n f=os.open(a,os.O_WRONLY|os.O_CREAT|os.O_TRUNC|os.O_NOFOLLOW,0o600)\n"
            " try:\n  os.write(f,os.fsencode(stub))\n finally:\n  os.close(f)\n"
            "except OSError as e:\n sys.exit('orch: cannot write %s: %s'%(a,e.strerror))\n"
            "line=sys.stdin.readline()\n"
            "if not os.path.isdir(h):\n"
            " if not line.strip():\n"   # not sent: the check saw it here (agent_home), it has gone since
            "  sys.exit('orch: %s is gone since the check found it there; run orch up again' % h)\n"
            " import base64,json,zlib\n"
            " t='%s.%d.tmp'%(h,os.getpid())\n"
            " os.mkdir(t,0o700)\n"
            f" os.mkdir(os.path.join(t,{AGENT_MODULE!r}),0o700)\n"
            " for n,s in json.loads(zlib.decompress(base64.b64decode(line))).items():\n"
            f"  f=os.open(os.path.join(t,{AGENT_MODULE!r},n),os.O_WRONLY|os.O_CREAT|os.O_EXCL|os.O_NOFOLLOW,0o600)\n"
            "  with os.fdopen(f,'w') as fh:\n   fh.write(s)\n"
            " try:\n  os.rename(t,h)\n"
            " except OSError:\n"   # another start put it there first
            "  import shutil\n  shutil.rmtree(t,True)\n  if not os.path.isdir(h):\n   raise\n"
            "if sys.argv[4:5]==['start']:\n"
            " sys.path.insert(0,h)\n"
            f" from {AGENT_MODULE}.cli import main\n from {AGENT_MODULE}.layout import leave\n"
            " leave(main([a,'start',r]+sys.argv[5:]))\n")


@_once
def agent_blob() -> str:
    """The agent package as _BOOT_PY reads it: one line of base64 (of zlib of _agent_json)."""
    return base64.b64encode(zlib.compress(_agent_json(), 9)).decode("ascii")


def _write_agent(rdir: str) -> str:
    """Shell: one python (_BOOT_PY) makes orch's directory in the workdir and the run's directory
    in it, both the user's alone (0700; never through a planted link, never one another user
    owns), writes the run's agent.py and makes sure the package is in <workdir>/.orch/agent-<hash>
    (Slurm's staged start; any other start is boot())."""
    return f"{_boot(rdir)} <<'ORCH_AGENT_EOF' || exit 1\n{agent_blob()}\nORCH_AGENT_EOF\n"


def _boot(rdir: str) -> str:
    """Shell: _BOOT_PY for the run directory `rdir` (its arguments: nothing secret)."""
    return " ".join([*PY, "-c", *(shlex.quote(a) for a in boot_args(rdir))])


def boot_args(rdir: str) -> list[str]:
    """What follows `python3 -S -c` in a start: _BOOT_PY and its arguments, for `rdir`."""
    home = _home_in(rdir.rsplit("/", 1)[0])
    return [_BOOT_PY, home, rdir, agent_stub(home)]


def _run_env(cfg: Mapping) -> dict[str, str]:
    return run_env(cfg["run_id"])


def run_env(run_id: str) -> dict[str, str]:
    """A supervisor's own environment: the run's id, and that it is a supervisor (what sweeps and
    `agent.py status` find it by, in /proc/PID/environ: the environment it was started with)."""
    return {RUN_VAR: run_id, layout.AGENT_VAR: "1"}


@dataclass(frozen=True)
class Boot:
    """A supervisor's start as its parts: its environment, the arguments after `python3 -S -c`
    (_BOOT_PY, which makes the run's directory, writes its agent.py and unpacks the package, then
    starts the supervisor), and the two lines its stdin gives it, in order: the package's (empty:
    the host has it, the check said so, AGENT_THERE: its ~95 KB are not sent again) and the
    configuration's (JSON on one line; secret env values included: never a command line, never a
    file). Nothing secret is in the command. The host's python unpacks and imports as soon as it
    has the package's line and waits for the configuration's: the head's is sent once the code is
    synced (lifecycle.Lifecycle.start). A member then waits for one more line, head_line(), once
    the head runs; stdin closed before the configuration, or a member's before the head's line:
    nothing starts there (the agent's NO_HEAD), and the run directory made for it is removed. No
    umask is forced: what the run writes gets the user's own. The supervisor prints
    `ok PID PORT ADDRS`, or `busy RUN` when another live run holds the workdir."""

    env: dict[str, str]
    args: list[str]
    package: bytes
    conf: bytes

    @property
    def command(self) -> str:
        """A session's command for it (a host whose check's python3 waits to be its supervisor,
        reach.HOLD_PY, takes env and args as they are)."""
        return boot_command(self.env, self.args)


def boot(cfg: Mapping, send: bool = True) -> Boot:
    """The start of the supervisor of configuration `cfg`; `send=False`: the host has the package."""
    conf = json.dumps(cfg, separators=(",", ":"))
    assert "\n" not in conf
    return Boot(_run_env(cfg), [*boot_args(cfg["rundir"]), "start"],
                f"{agent_blob() if send else ''}\n".encode(), f"{conf}\n".encode())


def boot_command(env: Mapping[str, str], args: Sequence[str]) -> str:
    """Shell: `python3 -S -c ARGS...` with `env`, in the shell's place."""
    return f"{sh.assignments(env)} exec {' '.join([*PY, '-c', *(shlex.quote(a) for a in args)])}"


def head_line(port: int, addresses: Sequence[str]) -> bytes:
    """The line a member's start waits for (Boot): where the head listens, its addresses
    in its order (an older head names none: the configuration's own then)."""
    at = {"head_addresses": list(addresses), "head_address": addresses[0]} if addresses else {}
    return (json.dumps({"head_port": port, **at}, separators=(",", ":")) + "\n").encode()


def stage_script(cfg: Mapping) -> str:
    """Slurm: write the supervisor and its configuration into the run directory, for the job
    step that starts it (`agent.py start --foreground --config`). The configuration file is
    the user's alone (0600) and the supervisor removes it once read."""
    rdir = cfg["rundir"]
    conf = json.dumps(cfg, separators=(",", ":"))
    assert "\nORCH_CFG_EOF\n" not in conf
    path = shlex.quote(f"{rdir}/{config_name(cfg['host'])}")
    return (_write_agent(rdir) + f"rm -f {path}\n(umask 077 && cat > {path}) <<'ORCH_CFG_EOF' || exit 1\n{conf}\n"
            "ORCH_CFG_EOF\necho staged\n")


def config_name(host: str) -> str:
    """The file a Slurm job step's supervisor reads its configuration from (layout.CONFIG)."""
    return layout.CONFIG.format(node=host)


def go_text(cluster: Cluster, plan: RankPlan, run_id: str) -> str:
    """Slurm: what the batch script waits for: the run directory, then who runs where."""
    head = plan.launch_host.name
    spec = {"run_id": run_id, "head": head, "members": [h.name for h in plan.all_hosts if h.name != head],
            "no_kill": bool(plan.spares), "python": list(PY),
            "start_timeout": START_TIMEOUT, "members_grace": batch_grace(cluster)}
    return f"{run_dir(cluster, run_id)}\n{json.dumps(spec)}\n"


def parse_start(text: str) -> tuple[str, int, int, tuple[str, ...]]:
    """`ok PID PORT [ADDR,ADDR...]` -> ("ok", pid, port, (addresses the head listens on, in
    preference order; () when not given)); `busy RUN` -> ("busy:RUN", 0, 0, ()); else ("error", 0, 0, ())."""
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["ok"] and len(parts) in (3, 4) and parts[1].isdigit() and parts[2].isdigit():
            addrs = tuple(a for a in parts[3].split(",") if a and a != "-") if len(parts) == 4 else ()
            return "ok", int(parts[1]), int(parts[2]), addrs
        if parts[:1] == ["busy"] and len(parts) == 2:
            return "busy:" + parts[1], 0, 0, ()
    return "error", 0, 0, ()


# python3 as the supervisor runs it (PY): its major.minor (PYTHON_PY); with FACTS_ENV's variables
# (facts_env), what the start needs to know of the workdir: the run that holds its lock now (a
# live supervisor holds an exclusive flock on it), and whether this orch's agent package is there
# (AGENT_THERE). python_sh runs FACTS_PY on its own; check reach's test runs it first thing, so
# that a host starts one python3 for both (checks/reach.py: tests_by_python).
PYTHON_PY = "import sys\nprint(\"supervisor\\t%d.%d\" % sys.version_info[:2])\n"
FACTS_ENV = ("ORCH_FACTS_LOCK", "ORCH_FACTS_HOME")
AGENT_THERE = "agent here"  # the facts' line: the host has this orch's agent package (agent_home)
FACTS_PY = PYTHON_PY + (
    "import os\n"
    # the environments that name a run's directory: read by the probe's stale section where its
    # python3 gave it (checks/reach.py GIVEN_PY, _RD: one read of every process's for both), else here
    "def _rundirs():\n"
    " rd=globals().pop(\"_RD\",None)\n"
    " if rd is not None:\n  return rd\n"
    " out=[]\n"
    " for p in os.listdir(\"/proc\"):\n"
    "  if not p.isdigit():\n   continue\n"
    "  try:\n   with open(\"/proc/%s/environ\"%p,\"rb\") as f:\n    env=f.read()\n  except OSError:\n   continue\n"
    f"  if {(DIR_VAR + '=').encode()!r} in env:\n   out.append(env)\n"
    " return out\n"
    "def _live(l):\n"
    " import fcntl\n"
    " try:\n  fd=os.open(l,os.O_RDONLY|os.O_NOFOLLOW)\n except OSError:\n  fd=None\n"
    " if fd is not None:\n  try:\n   fcntl.flock(fd,fcntl.LOCK_SH|fcntl.LOCK_NB)\n"
    "  except OSError:\n   return os.read(fd,200).decode(\"utf-8\",\"replace\").strip() or \"?\"\n"
    # no supervisor holds the lock: a process of an earlier run in this workdir may still live (its
    # supervisor killed): it counts as live too, found by ORCH_RUN_DIR in its environment (each
    # environment searched whole first, in C: a python loop over every entry of every process's
    # took ~35 us a process)
    f" d=({DIR_VAR + '='!r}+os.path.dirname(l)+\"/\").encode()\n"
    " for env in _rundirs():\n"
    "  if d in env:\n"
    "   for e in env.split(b\"\\0\"):\n"
    "    if e.startswith(d):\n     return e[len(d):].decode(\"utf-8\",\"replace\").split(\"/\")[0]\n"
    f"l,h=(os.environ.pop(k,\"\") for k in {FACTS_ENV!r})\n"
    "r=_live(l) if l else None\n"
    "globals().pop(\"_RD\",None)\n"
    "if r:\n print(\"live\",r)\n"
    f"if h and os.path.isdir(h):\n print({AGENT_THERE!r})\n")


def facts_env(lock: str | None = None, home: str | None = None) -> dict[str, str]:
    """FACTS_PY's environment: with `lock`, the run that holds it; with `home` (agent_home),
    whether the package is there."""
    return {k: v for k, v in zip(FACTS_ENV, (lock, home)) if v}


def lock_path(cluster: Cluster) -> str:
    return posixpath.join(orch_dir(cluster.job.workdir), layout.LOCK)


def agent_home(cluster: Cluster) -> str:
    """Where this orch's agent package lives on the hosts: <workdir>/.orch/agent-<hash>."""
    return _home_in(orch_dir(cluster.job.workdir))


def workdir_facts(cluster: Cluster) -> dict[str, str]:
    """facts_env of the cluster's workdir: its lock and this orch's agent package."""
    return facts_env(lock_path(cluster), agent_home(cluster))


def python_sh(facts: Mapping[str, str] | None = None) -> str:
    """Shell: `supervisor\tX.Y` for the python3 the supervisor would run (PY, on the plain
    non-interactive PATH), `supervisor\t` when there is none; with `facts` (facts_env), also
    `live RUN` when a run holds the workdir's lock now and AGENT_THERE when the package is there
    (the start then does not send it). Parsed by parse_python (and prepare.parse_prepare)."""
    env = sh.assignments(facts or {})
    prog = FACTS_PY if env else PYTHON_PY
    return f"{env + ' ' if env else ''}{' '.join(PY)} -c {shlex.quote(prog)} 2>/dev/null || printf 'supervisor\\t\\n'"


def parse_python(text: str) -> str | None:
    """python_sh's version: "X.Y", "" when there is no python3, None when the text has no such line."""
    for line in text.splitlines():
        kind, tab, rest = line.partition("\t")
        if kind == "supervisor" and tab:
            return rest.strip()
    return None


def python_problem(version: str | None) -> str | None:
    """What is wrong with a host's python3 for the supervisor (None: nothing). `version` is
    its major.minor, "" or None when there is no python3 on the non-interactive PATH."""
    need = ".".join(map(str, MIN_PYTHON))
    if not version:
        return f"no python3 on the non-interactive ssh PATH (the run's supervisor needs python3 >= {need})"
    try:
        got = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"python3 reports version {version!r}; the run's supervisor needs >= {need}"
    if got < MIN_PYTHON:
        return f"python3 is {version}; the run's supervisor needs >= {need}"
    return None


def agent_argv(cluster: Cluster, run_id: str, *args: str) -> list[str]:
    rdir = run_dir(cluster, run_id)
    return [*PY, f"{rdir}/{AGENT}", args[0], rdir, *args[1:]]


def status_script(cluster: Cluster, run_id: str | None) -> str:
    """This host's view of a run (`agent.py status`); without a run id, the latest run in the
    workdir (run ids sort by start time)."""
    base = orch_dir(cluster.job.workdir)
    if run_id is not None:
        return shlex.join(agent_argv(cluster, run_id, "status")) + " 2>/dev/null || echo '{}'"
    return (f"d=$(ls -1d {shlex.quote(base)}/*/state.json 2>/dev/null | sort | tail -n 1)\n"
            "[ -n \"$d\" ] || { echo '{}'; exit 0; }\nd=${d%/state.json}\n"
            f"{' '.join(PY)} \"$d/agent.py\" status \"$d\" 2>/dev/null || echo '{{}}'")


def parse_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return {}


def sweep_script(run_id: str, signal_name: str | None, grace: float = STOP_GRACE) -> str:
    """Signal every process of this run on a host (found by ORCH_RUN_ID in its environment),
    supervisors included; with TERM, wait up to `grace` seconds, then KILL what is left.
    The last resort after asking the run's head to stop it. Prints what it did."""
    find = sh.pids_function(RUN_VAR, run_id)
    if signal_name is None:
        return find + "find_pids | tr '\\n' ' '\n"
    steps = int(grace / 0.2)
    return (find + "pids=$(find_pids)\n[ -z \"$pids\" ] && { echo none; exit 0; }\n"
            f"kill -{signal_name} $pids 2>/dev/null\n"
            f"i=0\nwhile [ $i -lt {steps} ]; do sleep 0.2; pids=$(find_pids); [ -z \"$pids\" ] && break; i=$((i+1)); done\n"
            "if [ -n \"$pids\" ]; then kill -KILL $pids 2>/dev/null; echo killed $pids; else echo stopped; fi\n")


def sweep_status_script(cluster: Cluster, run_id: str) -> str:
    """sweep_script (TERM), then this host's view of the run (status_script): what the sweep
    did on the first line, the run's `agent.py status` document last (parse_sweep_status)."""
    return f"(\n{sweep_script(run_id, 'TERM')})\n{status_script(cluster, run_id)}\n"


def parse_sweep_status(text: str) -> tuple[str, dict]:
    """sweep_status_script's output -> (what the sweep did, the status document)."""
    first, _, rest = text.strip().partition("\n")
    return first.strip(), parse_json_line(rest)


class EventStream:
    """A file-like sink for `agent.py watch`'s stdout: parses its frames as they arrive.

        E <json>\\n                          the head's state -> on_state(doc)
        D <json>\\n                          what changed in it -> on_state(the state, changed)
        O <rank> <attempt> <n>\\n<n bytes>   a rank's new output -> on_output(rank, attempt, data)
        H\\n                                 a heartbeat -> on_beat() (at least once a second)
        X <why>\\n                           the end of the stream -> self.end = why
    """

    def __init__(self, on_state: Callable[[dict], None], on_output: Callable[[int, int, bytes], None],
                 on_beat: Callable[[], None] | None = None):
        self.on_state = on_state
        self.on_output = on_output
        self.on_beat = on_beat
        self.buf = bytearray()
        self.need: tuple[int, int, int] | None = None
        self.end: str | None = None
        self.last_state: dict | None = None
        self.heard: float | None = None   # time.monotonic() of the last bytes received

    def write(self, data: bytes) -> int:
        self.heard = time.monotonic()
        self.buf += data
        while True:
            if self.need is not None:
                rank, attempt, n = self.need
                if len(self.buf) < n:
                    return len(data)
                chunk = bytes(self.buf[:n])
                del self.buf[:n]
                self.need = None
                self.on_output(rank, attempt, chunk)
                continue
            i = self.buf.find(b"\n")
            if i < 0:
                return len(data)
            line = bytes(self.buf[:i])
            del self.buf[:i + 1]
            kind, _, rest = line.partition(b" ")
            if kind == b"E":
                try:
                    doc = json.loads(rest)
                except ValueError:
                    continue
                if isinstance(doc, dict) and doc:
                    self.last_state = doc
                    self.on_state(doc)
            elif kind == b"D" and self.last_state is not None:   # what changed (agent/delta.py)
                try:
                    delta.apply(self.last_state, json.loads(rest))
                except ValueError:
                    continue
                self.on_state(self.last_state)
            elif kind == b"O":
                parts = rest.split()
                if len(parts) == 3 and all(p.isdigit() for p in parts):
                    self.need = (int(parts[0]), int(parts[1]), int(parts[2]))
            elif kind == b"H" and self.on_beat is not None:
                self.on_beat()
            elif kind == b"X":
                self.end = rest.decode("ascii", "replace") or "end"

    def flush(self) -> None:
        pass


def watch(transport: Transport, cluster: Cluster, run_id: str, stream: EventStream, *, attempt: int | None = None,
          offsets: Mapping[int, int] | None = None, to_end: bool = False, **run_kw: Any) -> None:
    """The one client of `agent.py watch` on a host (`orch up` following, `orch logs -f`): the
    run's state into `stream` as the head pushes it, and the output of the ranks in `offsets`
    ({rank: bytes already here}) of `attempt`, until those ranks have ended (`to_end`: until the
    run has). A stream silent for lost_after + 5 s is given up (RemoteTimeout); `run_kw` goes to
    the transport's run."""
    window = lost_after(cluster)
    args = ["watch", *(["--to-end"] if to_end else []), *(["--attempt", str(attempt)] if attempt is not None else [])]
    for r, offset in (offsets or {}).items():
        args += ["--rank", str(r), "--offset", f"{r}={offset}"]
    transport.run(agent_argv(cluster, run_id, *args), env={"ORCH_LOST_AFTER": str(int(window))}, sink=stream,
                  timeout=window + 5, **run_kw)
