"""Rank logs: where they are on the hosts, their copies on the controller, reading them.

On a host, attempt K of a run writes rank N's output to <workdir>/.orch/<run>/a<K>/1/rank.N/stdout
(mpirun's layout; msrun: a<K>/worker_N.log), and <workdir>/<log_dir> points at the latest
attempt. On the controller, `.orch/runs/<run>/logs/rank.N/stdout` holds attempt 1 (the only
one unless job.restarts) and `logs/attempt-K/rank.N/stdout` attempt K > 1. Copies grow
incrementally (only new bytes are written; a host's logs of which little is here yet travel
whole, as one tar stream) under a lock per rank, so two commands gathering one run never
duplicate bytes. Reading streams blocks: memory stays bounded whatever the size.
"""

from __future__ import annotations

import fcntl
import json
import os
import posixpath
import re
import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Mapping

from .errors import LocalWriteError, LogsIncomplete, OrchError, UsageError
from .fanout import fan_out
from .launchers import launcher
from .hostlayout import PY, run_dir
from .rankplan import current_hosts, ranks_by_host
from .runs import Run
from . import supervisor
from .transport import Pool

_LOG = re.compile(r"/a([0-9]+)/(?:1/rank\.0*([0-9]+)/stdout|worker_0*([0-9]+)\.log)$")  # (attempt, rank)


def _private(path: str, flags: int) -> int:
    """open()'s opener for a file only the user may read: 0600, never through a link."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


@contextmanager
def _locked(path: Path):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError as exc:  # this machine's disk: never taken for a lost connection
        raise LocalWriteError.of_log(path.parent, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Copies:
    """The local copies of streamed logs: each (rank, attempt)'s bytes go where the last ended
    (its copy's size when first seen)."""

    def __init__(self, run: Run):
        self.run = run
        self.pos: dict[tuple[int, int], int] = {}

    def offset(self, rank: int, attempt: int) -> int:
        return self.pos.setdefault((rank, attempt), self.run.local_size(rank, attempt))

    def add(self, rank: int, attempt: int, data: bytes) -> None:
        """LocalWriteError when this machine cannot keep them (the position moves on all the same)."""
        at = self.offset(rank, attempt)
        try:
            append(self.run, rank, attempt, at, data)
        finally:
            self.pos[(rank, attempt)] = at + len(data)


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
            raise LocalWriteError.of_log(local, exc) from None


# Runs on a host (python3 -S, stdlib only): the new bytes of every log of the given ranks (every
# attempt), as the listing finds them, and the launcher's own log, in one framed stream:
#   R <attempt> <rank>\n                          a log rewritten there (shorter than here): again from 0
#   D <attempt> <rank> <offset> <n>\n<n bytes>   a log's bytes from <offset>
#   L <n>\n<n bytes>                             the launcher's log, whole, in pieces
GATHER_PY = r'''
import glob, json, os, re, sys
req = json.loads(sys.argv[1])
rd, mine, have = glob.escape(req["dir"]), set(req["ranks"]), req["have"]
out = sys.stdout.buffer
pat = re.compile(req["pattern"])
found = {}
for f in sorted(glob.glob(rd + "/a*/1/rank.*/stdout")) + sorted(glob.glob(rd + "/a*/worker_*.log")):
    m = pat.search(f)
    if m and os.path.isfile(f):
        found[(int(m.group(1)), int(m.group(2) or m.group(3)))] = f

def send(path, head, off, again=b""):
    try:
        fh = open(path, "rb")
    except OSError:
        return
    with fh:
        end = os.fstat(fh.fileno()).st_size
        if end < off:
            out.write(again)
            off = 0
        fh.seek(off)
        while off < end:
            data = fh.read(min(1 << 20, end - off))
            if not data:
                break
            out.write(head(off, len(data)) + data)
            off += len(data)

for (a, r), f in sorted(found.items()):
    if r in mine:
        send(f, lambda off, n: b"D %d %d %d %d\n" % (a, r, off, n), have.get("%d:%d" % (a, r), 0),
             b"R %d %d\n" % (a, r))
if req.get("launcher"):
    send(req["launcher"], lambda off, n: b"L %d\n" % n, 0)
out.flush()
'''


class _Gathered:
    """The sink of a host's gather stream: each log's bytes into its local copy as `append` puts
    them (under the copy's lock, held while its bytes come; never a byte twice, never a gap),
    the launcher's log into a temporary file that replaces its copy once the stream is complete."""

    def __init__(self, run: Run, launcher: Path | None):
        self.run = run
        self.buf = bytearray()
        self.left = 0               # bytes of the current frame still to come
        self.skip = 0               # of which to drop (already here)
        self.out: BinaryIO | None = None  # where the current frame's kept bytes go
        self.key: tuple[int, int] | None = None
        # (its lock, the file written, the copy it becomes or None) of log self.key
        self.log: tuple[Any, BinaryIO, Path | None] | None = None
        self.pos = 0                # the local copy's size
        self.launcher = launcher
        self.tmp: tuple[Path, BinaryIO] | None = None

    def write(self, data: bytes) -> int:
        self.buf += data
        while self.buf:
            if self.left:
                n = min(self.left, len(self.buf))
                drop = min(self.skip, n)
                if self.out is not None and n > drop:
                    try:
                        self.out.write(self.buf[drop:n])
                    except OSError as exc:
                        if self.out is not self.tmp_fh:  # named as the copy (a new one is a temporary file)
                            raise LocalWriteError.of_log((self.log and self.log[2]) or self.out.name, exc) from None
                        self.out, self.launcher = None, None  # left out, as gather does when it cannot be kept
                    else:
                        if self.out is not self.tmp_fh:
                            self.pos += n - drop
                del self.buf[:n]
                self.left -= n
                self.skip -= drop
                continue
            i = self.buf.find(b"\n")
            if i < 0:
                break
            line = bytes(self.buf[:i]).split()
            del self.buf[:i + 1]
            nums = [int(x) for x in line[1:] if x.isdigit()]
            if line[:1] == [b"D"] and len(line) == len(nums) + 1 == 5:
                attempt, rank, off, self.left = nums
                self._open(rank, attempt)
                assert self.log is not None  # _open opened it
                # as append(): the bytes [off, off + n) go at the copy's end; those below it are here already
                self.out, self.skip = (self.log[1], self.pos - off) if off <= self.pos else (None, 0)
            elif line[:1] == [b"R"] and len(line) == len(nums) + 1 == 3:
                self._open(nums[1], nums[0])
                self._truncate()
            elif line[:1] == [b"L"] and len(line) == len(nums) + 1 == 2:
                self._close_log(True)
                self.out, self.skip, self.left = self._launcher_file(), 0, nums[0]
            else:
                raise OrchError(f"unreadable gather stream: {b' '.join(line)[:100]!r}")
        return len(data)

    @property
    def tmp_fh(self):
        return self.tmp[1] if self.tmp else None

    def _open(self, rank: int, attempt: int) -> None:
        if self.key == (rank, attempt):
            return
        self._close_log(True)
        local = self.run.local_log(rank, attempt)
        lock = _locked(local)
        lock.__enter__()
        fh: BinaryIO
        try:
            try:   # one open, no stat first: 1,024 logs a gather at 128 x 8, on the controller's one core
                fh, tmp = open(local, "r+b"), None
                self.pos = fh.seek(0, os.SEEK_END)
            except FileNotFoundError:  # a new copy appears whole or not at all (as Transport.get writes one)
                fh, tmp = self._temp(local), local
                self.pos = 0
        except OSError as exc:
            lock.__exit__(None, None, None)
            raise LocalWriteError.of_log(local, exc) from None
        self.key, self.log = (rank, attempt), (lock, fh, tmp)

    @staticmethod
    def _temp(local: Path) -> BinaryIO:
        """A new file beside `local`, named by its path (fh.name), the user's alone (0600), made by
        this open (O_EXCL: never one someone put there): what mkstemp makes, in one open."""
        while True:
            try:
                return open(local.parent / f".{local.name}.{os.urandom(6).hex()}", "xb", opener=_private)
            except FileExistsError:
                continue

    def _truncate(self) -> None:
        """Rewritten there: the copy is fetched again from the start, into a new file."""
        assert self.log is not None  # a frame of the current log asks for it
        lock, fh, tmp = self.log
        if tmp is None:
            local = Path(fh.name)
            fh.close()
            try:
                self.log = (lock, self._temp(local), local)
            except OSError as exc:
                raise LocalWriteError.of_log(local, exc) from None
        self.pos = 0

    def _close_log(self, complete: bool) -> None:
        """Done with the current log: a new copy into place if `complete`, else away."""
        if self.log is not None:
            lock, fh, local = self.log
            self.log, self.key, self.out = None, None, None
            placed = False
            try:
                fh.close()
                if local is not None and complete:
                    os.replace(fh.name, local)
                    placed = True
            except OSError as exc:
                raise LocalWriteError.of_log(local or fh.name, exc) from None
            finally:
                if local is not None and not placed:
                    try:
                        os.unlink(fh.name)
                    except FileNotFoundError:
                        pass
                lock.__exit__(None, None, None)

    def _launcher_file(self):
        if self.launcher is None:
            return None
        if self.tmp is None:
            try:  # a launcher log that cannot be kept is left out, silently
                self.launcher.parent.mkdir(parents=True, exist_ok=True)
                fh = self._temp(self.launcher)
            except OSError:
                return None
            self.tmp = (Path(fh.name), fh)
        return self.tmp[1]

    def close(self, ok: bool) -> None:
        """The stream has ended (`ok`: completely): the launcher's log into place."""
        try:
            self._close_log(ok and not self.left)
        finally:
            if self.tmp is not None:
                path, fh = self.tmp
                try:
                    fh.close()
                    if ok and not self.left and self.launcher is not None:
                        os.replace(path, self.launcher)
                except OSError:
                    pass
                finally:
                    if path.exists():
                        path.unlink()

    def flush(self) -> None:
        pass


# A host's logs as one tar stream (`tar c`: no python start there, a tenth of GATHER_PY's CPU,
# what 1,024 logs at 128 hosts come back through in under a second) when nothing or little of
# them is here yet (a run's gather at its end: only the followed rank's bytes are); else, or with
# no tar on the host, GATHER_PY (only new bytes). The tar stream is told from GATHER_PY's frames by
# its first line, `T`; _Untar turns its members into the same frames for _Gathered.
TAR_SLACK = 64 << 10   # bytes of a host's logs here up to which they are sent whole (tar)


def _have(run: Run, ranks) -> dict[str, int]:
    """{"attempt:rank": bytes here} of the ranks' logs that have a copy here."""
    have = {}
    for rank in ranks:
        for attempt in range(1, _latest_local_attempt(run, [rank]) + 1):
            p = run.local_log(rank, attempt)
            if p.exists():
                have[f"{attempt}:{rank}"] = p.stat().st_size
    return have


def tar_name(run: Run, cluster, path: str | None) -> str | None:
    """A file of the run's directory on a host as its tar stream names it."""
    return posixpath.relpath(path, run_dir(cluster, run.id)) if path else None


def gather_script(run: Run, cluster, ranks, launcher_log: str | None = None,
                  have: Mapping[str, int] | None = None) -> str:
    """One host's gather (sh): its ranks' logs from the sizes here on (`have`, default: read
    here), as GATHER_PY frames or (little here yet, tar on the host) a `T` line and a tar stream
    of its logs (_Untar reads both)."""
    have = _have(run, ranks) if have is None else have
    rdir = run_dir(cluster, run.id)
    req = {"dir": rdir, "ranks": sorted(ranks), "have": have, "launcher": launcher_log, "pattern": _LOG.pattern}
    py = "exec " + shlex.join([*PY, "-c", GATHER_PY, json.dumps(req, separators=(",", ":"))])
    if sum(have.values()) > TAR_SLACK:
        return py
    q = shlex.quote
    launcher = tar_name(run, cluster, launcher_log)
    return (f"cd {q(rdir)} 2>/dev/null && command -v tar >/dev/null 2>&1 || {py}\n"
            "set --\nfor f in a*/1/rank.*/stdout a*/worker_*.log"
            + (f" {q(launcher)}" if launcher else "") + '; do [ -f "$f" ] && set -- "$@" "$f"; done\n'
            'echo T\n[ $# -gt 0 ] || exit 0\nexec tar cf - -- "$@"\n')


class _Untar:
    """The sink of a host's gather: GATHER_PY's frames go to _Gathered as they are; after a `T`
    line, a tar stream, each of whose members (a rank's log of this host, or the launcher's)
    becomes the frames GATHER_PY would have sent: `D attempt rank 0 size` (_Gathered keeps only
    the bytes past its copy), after `R attempt rank` when the log is shorter there than here."""

    def __init__(self, sink: _Gathered, ranks, have: Mapping[str, int], launcher: str | None):
        self.sink = sink
        self.mine = set(ranks)
        self.have = have
        self.launcher = launcher     # the launcher log's name in the stream
        self.mode: str | None = None  # "frames" | "tar", from the first line
        self.buf = bytearray()
        self.left = 0                # the current member's bytes still to come
        self.keep = False            # ... whether they go to the sink
        self.pad = 0                 # then this many bytes of padding
        self.ended = False           # the tar stream's end (a zero block) was seen
        self.members = 0

    def write(self, data: bytes) -> int:
        if self.mode == "frames":
            return self.sink.write(data)
        self.buf += data
        if self.mode is None:
            if len(self.buf) < 2:
                return len(data)
            if self.buf[:2] != b"T\n":
                self.mode = "frames"
                rest, self.buf = bytes(self.buf), bytearray()
                self.sink.write(rest)
                return len(data)
            self.mode = "tar"
            del self.buf[:2]
        while self.buf and not self.ended:
            if self.left:
                n = min(self.left, len(self.buf))
                if self.keep:
                    self.sink.write(bytes(self.buf[:n]))
                del self.buf[:n]
                self.left -= n
                continue
            if self.pad:
                n = min(self.pad, len(self.buf))
                del self.buf[:n]
                self.pad -= n
                continue
            if len(self.buf) < 512:
                break
            block = bytes(self.buf[:512])
            del self.buf[:512]
            if not block.strip(b"\0"):
                self.ended = True
                break
            self._member(block)
        return len(data)

    def _member(self, block: bytes) -> None:
        self.members += 1
        raw = block[124:136]
        if raw[0] & 0x80:   # GNU base-256, past 8 GiB
            size = int.from_bytes(raw[1:], "big")
        else:
            try:
                size = int(raw.strip(b"\0 ") or b"0", 8)
            except ValueError:
                raise OrchError(f"unreadable gather stream: a tar header {block[:100]!r}") from None
        name = block[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        if block[257:262] == b"ustar" and block[345:500].strip(b"\0"):
            name = block[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") + "/" + name
        self.left, self.pad, self.keep = size, -size % 512, False
        if block[156:157] not in (b"0", b"\0"):   # not a file (a directory, GNU/pax extra headers): skipped
            return
        m = _LOG.search("/" + name)
        if name == self.launcher:
            self.sink.write(b"L %d\n" % size)
        elif m and int(m.group(2) or m.group(3)) in self.mine:
            a, r = int(m.group(1)), int(m.group(2) or m.group(3))
            if size < self.have.get(f"{a}:{r}", 0):
                self.sink.write(b"R %d %d\n" % (a, r))
            self.sink.write(b"D %d %d 0 %d\n" % (a, r, size))
        else:
            return
        self.keep = True

    def complete(self, rc: int) -> bool:
        """Did the host send everything, given its exit status: GATHER_PY's frames (0), or a tar
        stream to its end (0, or GNU tar's 1: a file changed while it was read; what it sent of
        it is whole), or none at all (no log there)."""
        if self.mode != "tar":
            return rc == 0
        return (self.ended and rc in (0, 1)) or (rc == 0 and not self.members and not self.buf)

    def flush(self) -> None:
        pass


def gather(run: Run, cluster, plan, pool, hosts=None, launcher_attempt: int | None = None) -> dict[str, str]:
    """Fetch every rank's new log bytes (every attempt) from every given host, in one round trip
    per host; with `launcher_attempt`, the launcher's own log of that attempt too (mpirun's /
    msrun's own words when it failed before any rank ran), into launcher/a<K>-node<N>-<name> (N: the
    host's place in the plan; host names may hold anything).
    A host that answered but whose gather failed still gets its launcher log read alone; one that
    cannot be reached is not asked again. Never raises: {host: "ok" or why not}."""
    launchers = launcher_hosts(cluster, plan) if launcher_attempt is not None else []
    ran = ranks_by_host(plan, run.data.get("replaced") or ())

    def one(h):
        remote = local = None
        if h.name in launchers:
            assert launcher_attempt is not None  # launchers is empty otherwise
            remote, local = launcher_log(run, cluster, plan, h, launcher_attempt)
        ranks = ran.get(h.name, [])
        have = _have(run, ranks)
        sink = _Gathered(run, local)
        untar = _Untar(sink, ranks, have, tar_name(run, cluster, remote))
        ok = False
        try:
            res = pool[h].run(gather_script(run, cluster, ranks, remote, have), sink=untar)
            ok = untar.complete(res.exit_code)
        finally:
            sink.close(ok)
        if not ok and remote is not None:
            try:  # it answered (an unreachable host raised above and is not asked again)
                pool[h].get(remote, local)
            except (OrchError, OSError):
                pass  # left out, silently: the ranks' logs say what matters
        if not ok:
            res.check("gathering logs")
            raise OrchError(f"{h.name}: gathering logs: the tar stream ended early")

    hosts = [h for h in (plan.all_hosts if hosts is None else hosts) if h.name in ran or h.name in launchers]
    res = fan_out(hosts, one, limit=cluster.ssh.fanout)
    return {n: ("ok" if o.ok else str(o.error)) for n, o in res.items()}


def launcher_hosts(cluster, plan) -> list[str]:
    """The hosts where the launcher itself (mpirun, msrun, torchrun) writes a log of its own."""
    return launcher(cluster).launcher_hosts(plan)


def launcher_log(run: Run, cluster, plan, h, attempt: int) -> tuple[str, Path]:
    """(where the launcher's log of `attempt` is on host h, where its copy goes here)."""
    import posixpath

    name = f"{cluster.job.launcher}.log"
    return (posixpath.join(run_dir(cluster, run.id), f"a{attempt}", name),
            run.dir / "launcher" / f"a{attempt}-node{plan.node_rank(h.name)}-{name}")


def select_ranks(run: Run, rank: int | None, host: str | None) -> list[int]:
    """The run's ranks, narrowed to `rank` and to the hosts `host` names (as --hosts does
    everywhere: names, addresses, ranges or groups, comma-separated; model.Cluster.select)."""

    ranks = run.data["plan"]["ranks"]
    if host is not None:

        wanted = {h.name for h in run.cluster().select(host).hosts}
        # a spare that took a lost host's place ran that host's ranks (the replacements the run recorded)
        ran = ranks_by_host(run.plan(), run.data.get("replaced") or ())
        mine = {r for h in wanted for r in ran.get(h, ())}
        ranks = [r for r in ranks if r["rank"] in mine]
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
        self.errors: dict[str, str] = {}  # hosts whose stream broke off: why

    def stream(self, cluster, plan, pool):
        import queue
        import threading


        q: queue.Queue = queue.Queue(maxsize=64)
        by_host: dict[str, list[int]] = {}
        now = current_hosts(plan, self.run.data.get("replaced") or ())
        for r in self.ranks:
            by_host.setdefault(now[r], []).append(r)

        def one(host: str, ranks: list[int]) -> None:
            copies = Copies(self.run)

            def on_output(r: int, attempt: int, data: bytes) -> None:
                copies.add(r, attempt, data)
                q.put(("out", r, data))

            def on_state(doc: dict) -> None:
                self.final = doc

            try:
                supervisor.watch(pool[host], cluster, self.run.id, supervisor.EventStream(on_state, on_output),
                                 attempt=self.attempt, offsets={r: self.run.local_size(r, self.attempt) for r in ranks})
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
            else:  # "error": that host's ranks were not followed to their end
                self.errors[who] = str(data)

    def exit_ok(self) -> bool:
        """No selected rank failed (exited non-zero or died of a signal of its own), as far as the
        run's last state says. A rank stopped by orch (fail-fast elsewhere, `orch down`) did not."""
        states = {r["rank"]: r.get("state") for r in (self.final or {}).get("ranks") or []}
        return not any(states.get(r) == "failed" for r in self.ranks)


def iter_logs(run: Run, ranks: list[int], *, follow: bool = False, tail: int | None = None,
              prefix: bool = False, attempt: int | None = None, follower: Follow | None = None):
    """Yield log bytes, a block at a time (memory stays bounded whatever the log size). A finished
    run is served from the gathered copies without touching the hosts; a running one is gathered
    first (only new bytes move), and with `follow`, streamed until every selected rank has ended."""

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
        if follower is not None:  # nothing left to follow: the ranks' states are the recorded ones
            follower.final = {"ranks": run.data.get("ranks") or []}
        yield from first_pass(attempt or run.attempt)
        yield from flush_pending()
        ran = ranks_by_host(run.plan(), run.data.get("replaced") or ())
        hosts = {h for h, rs in ran.items() if set(rs) & set(ranks)}
        _raise_incomplete({h: why for h, why in still.items() if h in hosts})
        return
    cluster = run.cluster()
    plan = run.plan()
    with Pool(cluster) as pool:  # only the selected ranks' hosts are asked
        if plan.spares:   # the run may have put spares in lost hosts' places: the head's word on it
            _read_replaced(run, cluster, plan, pool)
        ran = ranks_by_host(plan, run.data.get("replaced") or ())
        hosts = {h for h, rs in ran.items() if set(rs) & set(ranks)}
        got = gather(run, cluster, plan, pool, [h for h in plan.all_hosts if h.name in hosts])
        short = {h: why for h, why in got.items() if why != "ok"}
        k = attempt or _latest_local_attempt(run, ranks)
        yield from first_pass(k)
        if follow:
            f = follower or Follow(run, ranks, k)
            f.attempt = k
            for r, data in f.stream(cluster, plan, pool):
                yield from emit(r, data)
            short.update(f.errors)
    yield from flush_pending()
    _raise_incomplete(short)


def _read_replaced(run: Run, cluster, plan, pool) -> None:
    """A running run's replacements so far, as its head records them, into run.data (not saved:
    the run's end records them): one round trip to the launch host; nothing when it cannot say."""

    try:
        res = pool[plan.launch_host].run(supervisor.status_script(cluster, run.id))
    except OrchError:
        return
    replaced = supervisor.parse_json_line(res.out).get("replaced")
    if isinstance(replaced, list) and all(isinstance(r, dict) and {"host", "by"} <= set(r) for r in replaced):
        run.data["replaced"] = replaced


def _raise_incomplete(short: Mapping[str, str]) -> None:
    """LogsIncomplete naming the hosts whose logs could not be brought here, and why."""
    if short:
        raise LogsIncomplete("incomplete: the logs of " + "; ".join(
            f"{h} ({why.splitlines()[0] if why else 'no reason given'})" for h, why in sorted(short.items()))
            + " could not be brought here", hint="fix that, then run the same command again: only what is missing moves")


def _complete(run: Run) -> dict[str, str]:
    """A finished run whose logs some hosts could not give: try those hosts again.
    {host: why} of those that still cannot."""

    cluster = run.cluster()
    plan = run.plan()
    hosts = [h for h in plan.all_hosts if h.name in set(run.data["logs_incomplete"])]
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
