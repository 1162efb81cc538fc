"""Rank logs: where they are on the hosts, their copies on the controller, reading them.

On a host, attempt K of a run writes rank N's output to <workdir>/.orch/<run>/a<K>/1/rank.N/stdout
(mpirun's layout; msrun: a<K>/worker_N.log), and <workdir>/<log_dir> points at the latest
attempt. On the controller, `.orch/runs/<run>/logs/rank.N/stdout` holds attempt 1 (the only
one unless job.restarts) and `logs/attempt-K/rank.N/stdout` attempt K > 1. Copies grow
incrementally (only new bytes move) under a lock per rank, so two commands gathering one
run never duplicate bytes. Reading streams blocks: memory stays bounded whatever the size.
"""

from __future__ import annotations

import fcntl
import os
import re
from contextlib import contextmanager
from pathlib import Path

from . import sh
from .errors import LocalWriteError, LogsIncomplete, OrchError
from .fanout import fan_out
from .launchers import run_dir
from .runs import Run

_LOG = re.compile(r"/a([0-9]+)/(?:1/rank\.0*([0-9]+)/stdout|worker_0*([0-9]+)\.log)$")
_INT = re.compile(r"[0-9]{1,18}", re.ASCII)


def listing_script(cluster, run_id: str) -> str:
    d = run_dir(cluster, run_id)
    return sh.sizes([sh.glob(d, "a*/1/rank.*/stdout"), sh.glob(d, "a*/worker_*.log")])


def parse_listing(text: str) -> dict[tuple[int, int], tuple[int, str]]:
    """The listing's output -> {(attempt, rank): (size, path)}. Lines it does not understand are ignored."""
    out = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        size, _, path = rest.partition(" ")
        m = _LOG.search(path)
        if kind == "log" and m and _INT.fullmatch(size):
            out[(int(m.group(1)), int(m.group(2) or m.group(3)))] = (int(size), path)
    return out


@contextmanager
def _locked(path: Path):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError as exc:  # this machine's disk: never taken for a lost connection
        raise LocalWriteError(f"cannot write {path.parent}: {exc.strerror or exc}",
                              hint="free some space here, then `orch logs` fetches the rest") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append(run: Run, rank: int, attempt: int, offset: int, data: bytes) -> None:
    """Put streamed bytes [offset, offset+len) of a rank's remote log into its local copy;
    bytes another command already copied are not written twice."""
    local = run.local_log(rank, attempt)
    with _locked(local):
        have = local.stat().st_size if local.exists() else 0
        if have < offset or have >= offset + len(data):
            return
        try:
            with open(local, "ab") as fh:
                fh.write(data[have - offset:])
        except OSError as exc:
            raise LocalWriteError(f"cannot write {local}: {exc.strerror or exc}",
                                  hint="free some space here, then `orch logs` fetches the rest") from None


def fetch(run: Run, transport, rank: int, attempt: int, path: str, size: int) -> int:
    """Bring the local copy of one rank's log up to date (only the new bytes move)."""
    local = run.local_log(rank, attempt)
    with _locked(local):
        have = local.stat().st_size if local.exists() else 0
        if size < have:  # rewritten remotely: start again
            have = 0
        if size == have:
            return 0
        return transport.get(path, local, offset=have)


def gather(run: Run, cluster, plan, pool, hosts=None) -> dict[str, str]:
    """Fetch every rank's new log bytes (every attempt) from every given host. Never raises:
    {host: "ok" or why not}."""
    def one(h):
        t = pool[h]
        found = parse_listing(t.run(listing_script(cluster, run.id)).check("listing logs").out)
        mine = {r.rank for r in plan.by_host(h.name)}
        n = 0
        for (attempt, rank), (size, path) in sorted(found.items()):
            if rank in mine:
                n += fetch(run, t, rank, attempt, path, size)
        return n

    hosts = plan.hosts if hosts is None else hosts
    res = fan_out(hosts, one, limit=cluster.ssh.fanout)
    return {n: ("ok" if o.ok else str(o.error)) for n, o in res.items()}


def fetch_launcher_logs(run: Run, cluster, plan, pool, attempt: int) -> None:
    """mpirun's / msrun's own output (what it said when it failed before any rank ran), into
    launcher/a<K>-node<N>-<name> (N: the host's place in the plan; host names may hold anything)."""
    import posixpath

    if cluster.job.launcher not in ("mpirun", "msrun", "torchrun"):
        return
    name = f"{cluster.job.launcher}.log"
    hosts = [plan.launch_host] if cluster.job.launcher == "mpirun" else list(plan.hosts)
    for h in hosts:
        try:
            pool[h].get(posixpath.join(run_dir(cluster, run.id), f"a{attempt}", name),
                        run.dir / "launcher" / f"a{attempt}-node{plan.node_rank(h.name)}-{name}")
        except (OrchError, OSError):
            pass


def select_ranks(run: Run, rank: int | None, host: str | None) -> list[int]:
    """The run's ranks, narrowed to `rank` and to the hosts `host` names (as --hosts does: a name
    or address, or names and ranges, comma-separated)."""
    from .errors import UsageError

    ranks = run.data["plan"]["ranks"]
    if host is not None:
        from ClusterShell.NodeSet import NodeSetParseError

        from .hostsets import expand

        wanted = {host}
        try:
            wanted.update(expand(host))
        except NodeSetParseError:
            pass  # an exact name holding anything: taken as it is
        ranks = [r for r in ranks if r["host"] in wanted or r["address"] in wanted]
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




class Follow:
    """`orch logs -f`: the selected ranks' output, pushed by each of their hosts as it is written
    (one stream per host), until they have ended. `final` is the run's state at the end."""

    def __init__(self, run: Run, ranks: list[int], attempt: int):
        self.run = run
        self.ranks = ranks
        self.attempt = attempt
        self.final: dict | None = None

    def stream(self, cluster, plan, pool):
        import queue
        import threading

        from . import supervisor

        q: queue.Queue = queue.Queue(maxsize=64)
        by_host: dict[str, list[int]] = {}
        for r in self.ranks:
            by_host.setdefault(plan.ranks[r].host, []).append(r)
        window = supervisor.lost_after(cluster)

        def one(host: str, ranks: list[int]) -> None:
            pos: dict[tuple[int, int], int] = {}

            def on_output(r: int, attempt: int, data: bytes) -> None:
                at = pos.setdefault((r, attempt), _size(self.run.local_log(r, attempt)))
                append(self.run, r, attempt, at, data)
                pos[(r, attempt)] = at + len(data)
                q.put(("out", r, data))

            def on_state(doc: dict) -> None:
                self.final = doc

            args = ["watch", "--attempt", str(self.attempt)]
            for r in ranks:
                args += ["--rank", str(r), "--offset", f"{r}={_size(self.run.local_log(r, self.attempt))}"]
            try:
                pool[host].run(supervisor.agent_argv(cluster, self.run.id, *args),
                               env={"ORCH_LOST_AFTER": str(int(window))},
                               sink=supervisor.EventStream(on_state, on_output), timeout=window + 5)
            except OrchError as exc:
                q.put(("error", host, exc))
            finally:
                q.put(("done", host, None))

        threads = [threading.Thread(target=one, args=(h, rs), daemon=True) for h, rs in by_host.items()]
        for t in threads:
            t.start()
        left = len(threads)
        while left:
            kind, who, data = q.get()
            if kind == "done":
                left -= 1
            elif kind == "out":
                yield who, data

    def exit_ok(self) -> bool:
        """No selected rank failed (exited non-zero or died of a signal of its own), as far as the
        run's last state says. A rank stopped by orch (fail-fast elsewhere, `orch down`) did not."""
        states = {r["rank"]: r.get("state") for r in (self.final or {}).get("ranks") or []}
        return not any(states.get(r) == "failed" for r in self.ranks)


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else 0


def iter_logs(run: Run, ranks: list[int], *, follow: bool = False, tail: int | None = None,
              prefix: bool = False, attempt: int | None = None, follower: Follow | None = None):
    """Yield log bytes, a block at a time (memory stays bounded whatever the log size). A finished
    run is served from the gathered copies without touching the hosts; a running one is gathered
    first (only new bytes move), and with `follow`, streamed until every selected rank has ended."""
    from .lifecycle import plan_from_run
    from .transport import Pool

    pending: dict[int, bytes] = {}

    def emit(r: int, data: bytes):
        out = _prefixed(r, data, pending) if prefix else data
        if out:
            yield out

    def first_pass(k: int):
        for r in ranks:
            path = run.local_log(r, k)
            start = tail_offset(path, tail) if tail is not None and path.exists() else 0
            for block in read_blocks(path, start):
                yield from emit(r, block)

    def flush_pending():
        if prefix:
            yield from (b"[rank %d] " % r + rest + b"\n" for r, rest in sorted(pending.items()))
            pending.clear()

    still: dict[str, str] = {}
    if run.finished and run.data.get("logs_incomplete"):
        still = _complete(run)
    if run.finished:
        yield from first_pass(attempt or run.attempt)
        yield from flush_pending()
        hosts = {run.data["plan"]["ranks"][r]["host"] for r in ranks}
        short = {h: why.splitlines()[0] for h, why in still.items() if h in hosts}
        if short:
            raise LogsIncomplete("incomplete: the logs of " + "; ".join(f"{h} ({why})" for h, why in sorted(
                short.items())) + " could not be brought here", hint="fix that, then run the same command again: "
                                                                     "only what is missing moves")
        return
    cluster = run.cluster()
    plan = plan_from_run(run)
    with Pool(cluster) as pool:
        gather(run, cluster, plan, pool)
        k = attempt or _latest_local_attempt(run, ranks)
        yield from first_pass(k)
        if follow:
            f = follower or Follow(run, ranks, k)
            f.attempt = k
            for r, data in f.stream(cluster, plan, pool):
                yield from emit(r, data)
    yield from flush_pending()


def _complete(run: Run) -> dict[str, str]:
    """A finished run whose logs some hosts could not give: try those hosts again.
    {host: why} of those that still cannot."""
    from .lifecycle import plan_from_run
    from .transport import Pool

    cluster = run.cluster()
    plan = plan_from_run(run)
    hosts = [h for h in plan.hosts if h.name in set(run.data["logs_incomplete"])]
    with Pool(cluster) as pool:
        res = gather(run, cluster, plan, pool, hosts)
    run.reload()
    run.data["logs_incomplete"] = sorted(n for n, why in res.items() if why != "ok")
    run.save()
    return {n: why for n, why in res.items() if why != "ok"}


def _latest_local_attempt(run: Run, ranks: list[int]) -> int:
    k = 1
    while any(run.local_log(r, k + 1).exists() for r in ranks):
        k += 1
    return k
