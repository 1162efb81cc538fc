"""The run's outputs brought back: `job.collect` (workdir paths, globs) after the run, and
`orch collect [PATH...]` on demand, from every host that has them, into
`.orch/runs/<id>/collect/<host>/<path>`.

One streamed round trip per host (COLLECT_PY, with what is here already): a file whose size and
modification time are those recorded here (`collect.json` in the run's directory) is not sent
again; every file sent comes with its SHA-256, checked here against the bytes received before
the file is put in place (atomically: written beside it, then renamed). A file that changed
while it was read is kept as read and fetched again next time; anything under the workdir that
resolves outside it (a link) is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from .errors import UsageError
from .fanout import fan_out
from .hostlayout import PY
from .runs import write_atomic
from .hostsets import fold

COLLECT_PY = r'''
import glob, hashlib, json, os, stat, sys
req = json.loads(sys.argv[1])
wd = os.path.realpath(req["workdir"])
have = req["have"]
out = sys.stdout.buffer
def emit(o):
    out.write(b"J " + json.dumps(o).encode() + b"\n")
seen = set()
for pat in req["paths"]:
    found = sorted(glob.glob(os.path.join(glob.escape(wd), pat), recursive=True))
    if not found:
        emit({"missing": pat})
    for m in found:
        files = [m] if not os.path.isdir(m) else sorted(os.path.join(d, f) for d, _, fs in os.walk(m) for f in fs)
        for f in files:
            rel = os.path.relpath(f, wd)
            if rel in seen:
                continue
            seen.add(rel)
            if not os.path.realpath(f).startswith(wd + os.sep):
                emit({"refused": rel, "why": "it resolves outside the workdir"})
                continue
            try:
                fh = open(f, "rb")
            except OSError as e:
                emit({"refused": rel, "why": e.strerror or str(e)})
                continue
            with fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                if have.get(rel) == [st.st_size, st.st_mtime_ns]:
                    emit({"same": rel})
                    continue
                emit({"file": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
                h = hashlib.sha256()
                while True:
                    data = fh.read(1 << 20)
                    if not data:
                        break
                    h.update(data)
                    out.write(b"B %d\n" % len(data) + data)
                try:
                    now = os.stat(f)
                    changed = (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns)
                except OSError:
                    changed = True
                emit({"end": rel, "sha256": h.hexdigest(), "changed": changed})
out.flush()
'''

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def path_problem(p: str) -> str | None:
    """Why `p` cannot be a collect path (relative to the workdir, inside it), or None."""
    if not isinstance(p, str) or not p.strip():
        return "an empty path"
    if "\0" in p or "\n" in p:
        return f"{p!r} holds a NUL or newline character"
    pp = PurePosixPath(p)
    if pp.is_absolute() or ".." in pp.parts:
        return f"{p!r} must be a path inside the workdir, relative to it (e.g. checkpoints/*.ckpt)"
    return None


def host_dir(name: str, index: int) -> str:
    """The directory of a host's files here: its name, or node<N> when the name is not a plain one."""
    return name if _SAFE.match(name) and name not in (".", "..") else f"node{index}"


@dataclass
class Collected:
    """What one host gave."""
    fetched: list[str] = field(default_factory=list)
    same: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class _Sink:
    """The host's stream -> files under `dest`, each checked against its SHA-256 before it is put
    in place; `manifest` ({path: [size, mtime_ns, sha256]}) records what is here."""

    def __init__(self, dest: Path, manifest: dict, mode: int):
        self.dest, self.manifest, self.mode = dest, manifest, mode
        self.buf = bytearray()
        self.need = 0
        self.cur: dict | None = None
        self.fh: BinaryIO | None = None
        self.tmp: Path | None = None
        self.hash: Any = None   # hashlib's sha256 of the file being written
        self.got = Collected()

    def write(self, data: bytes) -> int:
        self.buf += data
        while True:
            if self.need:
                take = bytes(self.buf[:self.need])
                if not take:
                    return len(data)
                del self.buf[:len(take)]
                self.need -= len(take)
                if self.fh is not None:
                    self.fh.write(take)
                    self.hash.update(take)
                    self.got.bytes += len(take)
                continue
            i = self.buf.find(b"\n")
            if i < 0:
                return len(data)
            line = bytes(self.buf[:i])
            del self.buf[:i + 1]
            kind, _, rest = line.partition(b" ")
            if kind == b"B" and rest.isdigit():
                self.need = int(rest)
            elif kind == b"J":
                try:
                    self.event(json.loads(rest))
                except (ValueError, TypeError, KeyError) as exc:
                    self.got.problems.append(f"a garbled answer: {exc}")

    def flush(self) -> None:
        pass

    def _target(self, rel: str) -> Path | None:
        why = path_problem(rel)
        if why:
            self.got.problems.append(f"refused {rel!r} from the host: {why}")
            return None
        return self.dest / rel

    def event(self, e: dict) -> None:
        if "missing" in e:
            self.got.missing.append(str(e["missing"]))
        elif "refused" in e:
            self.got.problems.append(f"{e['refused']}: {e.get('why')}")
        elif "same" in e:
            self.got.same += 1
        elif "file" in e:
            self.drop()
            target = self._target(str(e["file"]))
            self.cur = dict(e, target=target)
            if target is None:
                return
            for parent in reversed(target.relative_to(self.dest).parents):
                d = self.dest / parent
                if d.is_symlink():   # never write through a link planted here
                    self.got.problems.append(f"{e['file']}: {d} is a link; not written")
                    self.cur["target"] = None
                    return
            target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = target.with_name(f".{target.name}.orch-{os.getpid()}.tmp")
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, self.mode)
            self.fh = os.fdopen(fd, "wb")
            self.hash = hashlib.sha256()
        elif "end" in e and self.cur is not None and self.cur.get("file") == e["end"]:
            target = self.cur.get("target")
            if self.fh is None or target is None:
                self.cur = None
                return
            self.fh.close()
            self.fh = None
            if self.hash.hexdigest() != e.get("sha256"):
                self.got.problems.append(f"{e['end']}: the bytes received do not match the host's SHA-256; not kept")
                self.drop()
                return
            assert self.tmp is not None   # written since the file's start
            os.replace(self.tmp, target)
            self.tmp = None
            self.got.fetched.append(str(e["end"]))
            if e.get("changed"):
                self.got.problems.append(f"{e['end']}: it changed while it was read; kept as read, fetched "
                                         "again next time")
                self.manifest.pop(e["end"], None)
            else:
                self.manifest[e["end"]] = [self.cur["size"], self.cur["mtime_ns"], e["sha256"]]
            self.cur = None

    def drop(self) -> None:
        """A file whose end never came (the stream broke): its partial copy goes."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.tmp is not None:
            try:
                self.tmp.unlink()
            except OSError:
                pass
            self.tmp = None


def collect(run, cluster, plan, pool, paths, hosts=None) -> dict[str, Collected | str]:
    """Fetch `paths` (workdir-relative globs) from every host (default: the plan's): {host:
    Collected, or why the host could not be asked}. Never raises for a host."""

    bad = [why for why in (path_problem(p) for p in paths) if why]
    if bad:
        raise UsageError(f"cannot collect {bad[0]}")
    book_path = run.dir / "collect.json"
    try:
        book = json.loads(book_path.read_text())
    except (OSError, ValueError):
        book = {}
    mode = 0o600 if run.secret else 0o644
    index = {h.name: i for i, h in enumerate(plan.hosts)}
    sinks: dict[str, _Sink] = {}

    def one(h):
        mine = book.setdefault(h.name, {})
        sink = sinks[h.name] = _Sink(run.dir / "collect" / host_dir(h.name, index.get(h.name, 0)), mine, mode)
        req = {"workdir": cluster.job.workdir, "paths": list(paths),
               "have": {k: v[:2] for k, v in mine.items()}}
        try:
            pool[h].run([*PY, "-c", COLLECT_PY, json.dumps(req, separators=(",", ":"))],
                        sink=sink).check("collecting outputs")
        finally:
            sink.drop()

    res = fan_out(plan.hosts if hosts is None else hosts, one, limit=cluster.ssh.fanout)

    write_atomic(book_path, json.dumps(book, indent=1) + "\n", 0o600 if run.secret else 0o644)
    return {n: (sinks[n].got if o.ok and n in sinks else str(o.error)) for n, o in res.items()}


def lines(got: dict[str, Collected | str]) -> list[str]:
    """One line per host: what came, what was there already, what was missing or refused."""

    out, empty = [], []
    for host, g in sorted(got.items()):
        if isinstance(g, str):
            out.append(f"{host}: could not collect: {g.splitlines()[0] if g else 'no reason given'}")
            continue
        if not g.fetched and not g.same and not g.problems:
            empty.append(host)
            continue
        said = f"{host}: {len(g.fetched)} file(s) fetched ({g.bytes} bytes), {g.same} already here"
        if g.missing:
            said += "; nothing matched " + ", ".join(g.missing)
        out.append(said)
        out.extend(f"{host}: {p}" for p in g.problems)
    if empty:
        out.append(f"{fold(empty)}: nothing matched")
    return out
