"""Slurm: hosts from an allocation instead of a list (`inventory.slurm`).

How a run goes through Slurm:

1. `sbatch` submits a small batch script (one task per node) that holds the allocation.
   orch waits while the job is pending (showing its reason; Ctrl-C cancels it), then learns
   the nodes and their addresses (`scontrol show node`): each node becomes a host with the
   inventory's `defaults`, and everything orch does for listed hosts follows (preflight,
   plan, rank tables from each node's hccn.conf, sync), over ssh to the nodes.
2. orch stages the run's supervisor and its configuration on every node, then drops a
   "go" file next to the batch script. The batch script starts the supervisors as job
   steps (`srun --overlap`, one per node), so they, and the ranks they start, live and die
   with the Slurm job: the run goes on without the controller, `scancel` ends everything,
   the time limit ends the run `timeout`, a failed node makes it `lost`.
3. When the run ends, the supervisors exit, the steps end, the batch script ends and Slurm
   releases the allocation by itself; orch cancels the job on every other exit path.

The functions here are pure (argv, scripts, parsers); `Slurm` commands run through a
transport: this machine, or `slurm.login` over ssh.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import shlex
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable

from ClusterShell.NodeSet import NodeSetParseError

from .errors import OrchError, UsageError
from .hostsets import expand
from .hostlayout import PY, orch_dir
from .model import Cluster, Host, Slurm
from .transport import Transport, make_transport
from .agent.cli import step_argv

JOB_PREFIX = "orch-"
GO_WAIT = 1800  # seconds the batch script waits for orch (checks, sync) before giving the nodes back
UNKNOWN_LIMIT = 60  # seconds a job Slurm does not answer for may stay so while orch waits for it

# Slurm job states (scontrol/squeue/sacct spelling) that are not over yet.
LIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                  "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"})
# A Slurm job that ended -> what it means for the run when its supervisors could not say.
RUN_STATE = {"COMPLETED": "succeeded", "FAILED": "failed", "CANCELLED": "stopped", "TIMEOUT": "timeout",
             "DEADLINE": "timeout", "NODE_FAIL": "lost", "BOOT_FAIL": "lost", "PREEMPTED": "lost",
             "OUT_OF_MEMORY": "failed"}
# Pending reasons that waiting never resolves: the request itself cannot be met.
HOPELESS = {
    "PartitionNodeLimit": "the partition has fewer nodes than requested (or a per-job node limit)",
    "PartitionTimeLimit": "the requested time is above the partition's limit",
    "BadConstraints": "no node has the requested constraint/gres",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "QOSMaxNodePerJobLimit": "the QOS allows fewer nodes per job",
    "AssocMaxNodesPerJobLimit": "your association allows fewer nodes per job",
    "PartitionConfig": "the request does not fit the partition's configuration",
}


class SlurmError(OrchError):
    """Slurm refused or failed a request (its own words, translated)."""
    exit_code = 3


def job_name(cluster_name: str) -> str:
    return JOB_PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", cluster_name)[:60]


def go_path(workdir: str, job_id: str) -> str:
    return posixpath.join(orch_dir(workdir), f"slurm-{job_id}.go")


def batch_script(workdir: str, wait: int = GO_WAIT) -> str:
    """What sbatch runs on the first node (once, whatever --ntasks-per-node says): wait for orch's go file (which names the run's
    directory), then hand over to the run's supervisor (`agent.py batch`), which starts one
    supervisor per node as a job step. Without a go file in time, end (the nodes go back)."""
    go = shlex.quote(orch_dir(workdir) + "/") + '"slurm-$SLURM_JOB_ID.go"'
    return (
        "#!/bin/sh\n"
        "# orch: holds this allocation for one run; its supervisors are started as job steps.\n"
        f"go={go}\n"
        f"i=0\nwhile [ ! -s \"$go\" ]; do\n  i=$((i + 1))\n  [ $i -le {wait * 10} ] || "
        "{ echo 'orch: no go from orch in time; giving the nodes back' >&2; exit 1; }\n  sleep 0.1\ndone\n"
        "read -r rundir < \"$go\"\n"
        f"exec {' '.join(PY)} \"$rundir/agent.py\" batch \"$go\"\n"
    )


def sbatch_argv(s: Slurm, name: str, workdir: str, token: str = "-") -> list[str]:
    argv = ["sbatch", "--parsable", f"--job-name={name}", f"--nodes={s.allocated}",
            f"--ntasks-per-node={s.template.slots}",  # one task per rank: what mpirun sees as slots
            "--output=/dev/null", "--chdir=/", f"--comment=orch {token} {workdir}"]
    for opt, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos), ("time", s.time),
                       ("constraint", s.constraint), ("gres", s.gres)):
        if value is not None:
            argv.append(f"--{opt}={value}")
    if s.exclusive:
        argv.append("--exclusive")
    if s.spares:  # a node that fails ends the job unless --no-kill: the run's head replaces it instead
        argv.append("--no-kill")
    return argv + list(s.extra)


def parse_sbatch(out: str) -> str:
    """`--parsable` prints `ID` or `ID;CLUSTER`."""
    for line in out.splitlines():
        first = line.strip().split(";")[0]
        if first.isdigit():
            return first
    raise SlurmError(f"sbatch printed no job id: {out.strip()[-300:]!r}")


def translate(stderr: str, s: Slurm) -> str:
    """Slurm's refusal, said with what to do."""
    text = " ".join(stderr.split())
    low = text.lower()
    if "invalid partition" in low:
        return (f"Slurm has no partition {s.partition!r} (inventory.slurm.partition); `sinfo -s` lists them"
                if s.partition else f"Slurm has no default partition: set inventory.slurm.partition ({text})")
    if "node configuration is not available" in low or "node count specification invalid" in low:
        return (f"Slurm cannot give {s.allocated} node(s) with these settings (nodes unavailable): {text}; "
                "check inventory.slurm.nodes, partition, constraint and gres against `sinfo`")
    if "invalid account" in low:
        return f"Slurm refused the account {s.account!r}: {text}"
    if "invalid qos" in low:
        return f"Slurm refused the QOS {s.qos!r}: {text}"
    if "time limit" in low:
        return f"Slurm refused the time limit {s.time!r}: {text}"
    return f"Slurm refused the job: {text or '(no message)'}"


_KV = re.compile(r"(\w+)=(\S*)")


def parse_kv(line: str) -> dict[str, str]:
    """One `scontrol show -o` record -> {Key: value} (values with spaces keep their first word)."""
    return dict(_KV.findall(line))


@dataclass
class JobInfo:
    job_id: str
    state: str            # Slurm's (RUNNING, PENDING, COMPLETED, TIMEOUT, ...); "" if Slurm forgot it
    reason: str = ""
    nodes: tuple[str, ...] = ()
    batch_host: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE

    def to_dict(self) -> dict:
        return {"job_id": self.job_id, "state": self.state or "unknown", "reason": self.reason}


def expand_nodes(nodelist: str) -> tuple[str, ...]:
    if not nodelist or nodelist in ("(null)", "None"):
        return ()
    try:
        return tuple(expand(nodelist))
    except NodeSetParseError as exc:
        raise SlurmError(f"cannot read Slurm's node list {nodelist!r}: {exc}") from None


def parse_job(job_id: str, text: str) -> JobInfo:
    kv = parse_kv(text)
    state = kv.get("JobState", "").rstrip("+")
    return JobInfo(job_id, state, kv.get("Reason", "") if kv.get("Reason") != "None" else "",
                   expand_nodes(kv.get("NodeList", "")), kv.get("BatchHost", "") if kv.get("BatchHost") != "(null)"
                   else "")


def parse_sacct(job_id: str, text: str) -> JobInfo | None:
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0].split(".")[0] == job_id:
            return JobInfo(job_id, parts[1].split()[0].rstrip("+") if parts[1] else "",
                           nodes=expand_nodes(parts[2]) if len(parts) > 2 else ())
    return None


def parse_nodes(text: str) -> dict[str, str]:
    """`scontrol show node -o` -> {node name: address the controller reaches it at}."""
    out = {}
    for line in text.splitlines():
        kv = parse_kv(line)
        if "NodeName" in kv:
            out[kv["NodeName"]] = kv.get("NodeAddr") or kv.get("NodeHostName") or kv["NodeName"]
    return out


def hosts_of(s: Slurm, nodes: tuple[str, ...], addresses: dict[str, str]) -> tuple[Host, ...]:
    first_spare = len(nodes) - s.spares if s.spares else len(nodes)
    return tuple(replace(s.template, name=n, address=addresses.get(n, n), spare=i >= first_spare)
                 for i, n in enumerate(nodes))


def with_nodes(cluster: Cluster, job: JobInfo, addresses: dict[str, str]) -> Cluster:
    assert cluster.slurm is not None
    return replace(cluster, hosts=hosts_of(cluster.slurm, job.nodes, addresses))


def placeholder(cluster: Cluster) -> Cluster:
    """The cluster as it will look once allocated, for `orch plan`: nodes named node[1-N]."""
    assert cluster.slurm is not None
    names = tuple(f"node{i}" for i in range(1, cluster.slurm.allocated + 1))
    return replace(cluster, hosts=hosts_of(cluster.slurm, names, {}))


def plan_commands(cluster: Cluster) -> dict:
    """What `orch up` will run through Slurm, for `orch plan` (agent.py batch runs the steps)."""
    assert cluster.slurm is not None
    n = cluster.slurm.allocated
    rdir = posixpath.join(orch_dir(cluster.job.workdir), "<run-id>")

    nodes = [f"node{i}" for i in range(1, n + 1)]
    cmds = {"allocate": sbatch_argv(cluster.slurm, job_name(cluster.name), cluster.job.workdir),
            "head step": step_argv(nodes[:1], PY, rdir)}
    if n > 1:
        cmds["members step"] = step_argv(nodes[1:], PY, rdir, "--head-port", "<port>",
                                         "--head-addresses", "<addresses>", no_kill=bool(cluster.slurm.spares))
    return {"batch_script": batch_script(cluster.job.workdir), "commands": cmds}


# --------------------------------------------------------------------------- I/O


class Client:
    """Runs Slurm's commands where the inventory says: here, or on `slurm.login` over ssh."""

    def __init__(self, cluster: Cluster, connect: Callable[[Host], Transport] | None = None):
        """connect: the transport factory (a Pool's, `pool.__getitem__`: one connection to the login
        host per invocation, its jump hosts shared with the nodes', closed with the pool); without
        one, the client makes its own transport and closes it."""
        s = cluster.slurm
        assert s is not None
        self.slurm = s
        host = s.login_host or replace(s.template, name=s.login or "localhost", address=s.login or "localhost",
                                       connection="ssh" if s.login else "local",
                                       port=22 if s.login else s.template.port)
        self._owned = connect is None
        self.transport = make_transport(host, cluster.ssh) if connect is None else connect(host)
        self.env = {"SLURM_CONF": s.conf} if s.conf else None
        self.where = f"on {s.login}" if s.login else "here"

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float = 60):
        try:
            return self.transport.run(argv, env=self.env, stdin=stdin, timeout=timeout)
        except OrchError as exc:
            raise SlurmError(f"cannot run {argv[0]} {self.where}: {exc}") from None

    def close(self) -> None:
        if self._owned:
            self.transport.close()

    def submit(self, cluster: Cluster) -> str:
        s = self.slurm
        token = secrets.token_hex(4)  # in the job's comment: finds a job whose id sbatch never told us
        argv = sbatch_argv(s, job_name(cluster.name), cluster.job.workdir, token)
        try:
            res = self.run(argv, stdin=batch_script(cluster.job.workdir).encode())
        except BaseException:  # Ctrl-C or a timeout while sbatch ran: the job may be queued all the same
            self._cancel_by_token(job_name(cluster.name), token)
            raise
        if res.exit_code == 127:
            raise SlurmError(f"sbatch not found {self.where}",
                             hint="install Slurm's client commands, or set inventory.slurm.login to a host that "
                                  "has them")
        if not res.ok:
            raise SlurmError(translate(res.err or res.out, s), hint=f"the command was: {shlex.join(argv)}")
        return parse_sbatch(res.out)

    def _cancel_by_token(self, name: str, token: str) -> None:
        try:
            res = self.run(["squeue", "-h", "-n", name, "-o", "%i|%k"], timeout=20)
            for line in res.out.splitlines():
                jid, _, comment = line.partition("|")
                if jid.strip().isdigit() and f"orch {token} " in comment + " ":
                    self.run(["scancel", jid.strip()], timeout=20)
        except (OrchError, KeyboardInterrupt):
            pass

    def job(self, job_id: str) -> JobInfo:
        res = self.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
        if res.ok and "JobState=" in res.out:
            return parse_job(job_id, res.out)
        acct = self.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,NodeList"], timeout=30)
        info = parse_sacct(job_id, acct.out) if acct.ok else None
        return info or JobInfo(job_id, "")

    def addresses(self, nodes: tuple[str, ...]) -> dict[str, str]:
        res = self.run(["scontrol", "show", "node", "-o", ",".join(nodes)], timeout=30)
        if not res.ok:
            raise SlurmError(f"cannot read the allocated nodes: {(res.err or res.out).strip()[-300:]}")
        return parse_nodes(res.out)

    def cancel(self, job_id: str, wait: float = 30) -> JobInfo:
        """scancel, then wait (bounded) until Slurm says the job is over. A job Slurm does not
        answer for keeps state "" (unknown): never taken for ended."""
        res = self.run(["scancel", job_id], timeout=30)
        if not res.ok and "invalid job id" not in (res.err + res.out).lower():
            raise SlurmError(f"scancel {job_id} failed: {(res.err or res.out).strip()[-300:]}",
                             hint=f"cancel it yourself: scancel {job_id}")
        deadline = time.monotonic() + wait
        while True:
            info = self.job(job_id)
            if (info.state and not info.live) or time.monotonic() > deadline:
                return info
            time.sleep(0.2)

    def wait_running(self, job_id: str, on_pending: Callable[[str], None], poll: float = 0.5) -> JobInfo:
        """Until the job runs: `on_pending(reason)` each time the reason changes. A job that ends
        or whose reason can never resolve raises SlurmError (the job is cancelled first)."""
        last = None
        polls = 0
        unknown_since = None
        while True:
            info = self.job(job_id)
            if info.state == "RUNNING" and info.nodes:
                return info
            if not info.state:  # Slurm does not answer for it (yet): not forever
                unknown_since = unknown_since or time.monotonic()
                if time.monotonic() - unknown_since > UNKNOWN_LIMIT:
                    raise SlurmError(f"Slurm has not known job {job_id} for {UNKNOWN_LIMIT} s",
                                     hint=f"see `scontrol show job {job_id}`; cancel it with scancel {job_id}")
            else:
                unknown_since = None
            if info.state and not info.live:
                raise SlurmError(f"Slurm job {job_id} ended {info.state} before it started"
                                 + (f" ({info.reason})" if info.reason else ""))
            if info.reason in HOPELESS:
                self.cancel(job_id)
                raise SlurmError(f"Slurm job {job_id} cannot start: {HOPELESS[info.reason]} ({info.reason}); "
                                 "it was cancelled", hint="check inventory.slurm against `sinfo`")
            if info.reason != last:
                last = info.reason
                on_pending(info.reason or "queued")
            time.sleep(min(poll, 0.1 * 1.5 ** polls))  # most jobs start within a second: look often at first
            polls += 1


def allocate(cluster: Cluster, client: Client, on_pending: Callable[[str, str], None]
             ) -> tuple[Cluster, JobInfo]:
    """Submit and wait for the allocation; the cluster with the allocated nodes as hosts.
    Ctrl-C (or any error) while waiting cancels the request."""
    job_id = client.submit(cluster)
    try:
        info = client.wait_running(job_id, lambda reason: on_pending(job_id, reason))
        addresses = client.addresses(info.nodes)
    except BaseException:
        client.cancel(job_id, wait=10)
        raise
    if not info.batch_host:
        info.batch_host = info.nodes[0]
    return with_nodes(cluster, info, addresses), info


class Allocation:
    """A Slurm allocation held for one command: `with Allocation.request(cluster, on_pending) as a:`
    gives `a.cluster` (the nodes as hosts) and `a.job`; leaving the block releases it (cancels
    the job) unless `a.keep()` (a detached run) or `a.release(wait)` (a run that ends by itself)
    was called. Ctrl-C while queued cancels the request and raises KeyboardInterrupt."""

    def __init__(self, client: Client, cluster: Cluster, job: JobInfo):
        self.client, self.cluster, self.job = client, cluster, job
        self.done = False

    @classmethod
    @contextmanager
    def request(cls, cluster: Cluster, on_pending: Callable[[str, str], None]):
        client = Client(cluster)
        try:
            allocated, job = allocate(cluster, client, on_pending)
            alloc = cls(client, allocated, job)
            try:
                yield alloc
            finally:
                if not alloc.done:
                    alloc.release(0)
        finally:
            client.close()

    def record(self) -> dict:
        """What run.json keeps of the allocation (for status and down from any later shell)."""
        s = self.client.slurm
        return {"job_id": self.job.job_id, "batch_host": self.job.batch_host, "nodes": list(self.job.nodes),
                "login": s.login, "conf": s.conf,
                "login_host": s.login_host.to_dict() if s.login_host else None}

    def keep(self) -> None:
        self.done = True

    def release(self, wait: float) -> JobInfo:
        self.done = True
        return release(self.client, self.job.job_id, wait)


def release(client: Client, job_id: str, wait: float) -> JobInfo:
    """After a run: the batch script ends by itself once the supervisors have; wait for that
    (bounded), then cancel whatever is left, so nothing stays in the queue."""
    deadline = time.monotonic() + wait
    while True:
        info = client.job(job_id)
        if info.state and not info.live:
            return info
        if time.monotonic() > deadline:
            return client.cancel(job_id)
        time.sleep(0.3)


_ENDED_HOW = {"TIMEOUT": "its time limit was reached", "DEADLINE": "its deadline was reached",
              "NODE_FAIL": "a node failed", "BOOT_FAIL": "a node failed to boot", "PREEMPTED": "it was preempted",
              "CANCELLED": "it was cancelled (scancel)", "OUT_OF_MEMORY": "it ran out of memory"}


_REASON_ENDED = {"TimeLimit": "TIMEOUT", "NodeDown": "NODE_FAIL", "DeadLine": "DEADLINE"}
_SIGNALLED_ALL = ("TIMEOUT", "DEADLINE", "PREEMPTED")  # Slurm SIGTERMs every process of the job itself


def _killed_by_sigterm(ranks) -> bool:
    """Did every failed rank die of SIGTERM (its signal, or the 143 of a shell whose child did)?"""
    failed = [r for r in ranks if r.get("state") == "failed"]
    return bool(failed) and all(r.get("signal") == 15 or r.get("exit_code") == 143 for r in failed)


def apply(view, info: JobInfo) -> None:
    """Pure: add the Slurm job to a RunView; when Slurm ended the job before the run's
    supervisors could say how the run ended (they were killed with it), Slurm's word decides."""
    view.slurm = info.to_dict()
    state = info.state
    if state == "COMPLETING" and info.reason in _REASON_ENDED:  # being torn down: why says how it ended
        state = _REASON_ENDED[info.reason]
    if state in LIVE or not state:
        return
    # Slurm's SIGTERM at a time limit reaches the supervisors as "stop": they say `stopped`
    # (or nothing, if killed first: `lost`); Slurm knows better. It reaches the ranks at the same
    # moment: a supervisor that saw its ranks end before its own SIGTERM says `failed`, every
    # failed rank killed by SIGTERM (or a shell's 143 for it): Slurm's doing too.
    overrule = state in _ENDED_HOW and (view.state == "lost" or (view.state == "stopped" and state != "CANCELLED")
                                        or (view.state == "failed" and state in _SIGNALLED_ALL
                                            and _killed_by_sigterm(view.ranks)))
    if not view.final or overrule:
        view.state = RUN_STATE.get(state, "lost")
        view.message = f"Slurm job {info.job_id} ended {state}" + (
            f": {_ENDED_HOW[state]}" if state in _ENDED_HOW else "")
        for r in view.ranks:
            if r["state"] in ("running", "pending", "unknown"):
                r["state"] = {"timeout": "timeout", "lost": "lost"}.get(view.state, "stopped")


def job_view(client: Client, job_id: str) -> JobInfo | None:
    """The Slurm job of a run, as Slurm sees it now (None if Slurm cannot be asked)."""
    try:
        return client.job(job_id)
    except SlurmError:
        return None


def latest(cluster: Cluster) -> Cluster:
    """`orch status FILE` with no local record: the nodes of this cluster's latest orch job
    that Slurm still remembers (job name orch-<cluster name>)."""
    client = Client(cluster)
    try:
        res = client.run(["squeue", "-h", "-t", "all", "-n", job_name(cluster.name), "-o", "%i|%T|%N"], timeout=30)
        if not res.ok:
            raise SlurmError(f"squeue failed: {(res.err or res.out).strip()[-300:]}")
        jobs = []
        for line in res.out.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3 and parts[0].isdigit() and expand_nodes(parts[2]):
                jobs.append((int(parts[0]), parts[2]))
        if not jobs:
            raise UsageError(f"Slurm knows no job of {cluster.name!r} ({job_name(cluster.name)}) that ran on "
                             "nodes", hint="`orch status` in the directory that ran `orch up` reads its record")
        job_id, nodelist = max(jobs)
        info = JobInfo(str(job_id), "", nodes=expand_nodes(nodelist))
        return with_nodes(cluster, info, client.addresses(info.nodes))
    finally:
        client.close()
