"""Distribute code and rendered files to every host before launch.

What is synced (`manifest()`, local I/O only):
- `job.sync` paths, relative to the cluster file's directory; a relative path that leaves it
  (`../../etc/shadow`) is refused: write it as an absolute path if you mean it.
- Directories are walked without following links. A symlink whose target stays inside the
  synced tree is recreated as the same link on the hosts (a dangling one too, as rsync -a
  does); a link that leaves the tree, or a link loop, is refused, naming the link and its target.
- Left out: `.git/`, `__pycache__/`, `*.pyc`, `.orch/`, then the patterns of
  `job.sync_exclude` and of a `.orchignore` (or, if there is none, `.gitignore`) at the top of
  each synced directory (gitignore's syntax: `name`, `dir/`, `/anchored`, `a/*.py`, `!keep`).
- Modes: a file's permission bits without group/other write (no 0777 from a laptop); a
  mode-only change (`chmod +x run.sh`) is applied on the hosts.

How (`sync_host()`, two round trips per host, whatever the number of files):
1. The receiver (stdlib python, on the host) creates workdir and lists what it has of the
   manifest's paths: kind, size, mtime, mode (a sha256 for rendered files).
2. One stream of everything that differs (rsync's quick check: kind, size, mtime, mode;
   mtimes are kept on the hosts). Each file is written under a temp name that says so,
   checked for its full size and sha256, then renamed into place; an interrupted stream
   leaves no partial file under a real name. Nothing is written through a symlink or a
   directory another user planted inside workdir.

Through the launch host (`sync_hosts()`, job.sync_via: launch-host): every host lists (1.); then
one request to the launch host (cmd_relay) carries its own stream (2.), which it writes and, as
it arrives, passes on to each other host that lacks it, with the rest of what they lack from its
own copy: the code crosses the controller's link once. Every hop is checked against the
controller's sha256: the launch host's copy before it is passed on (a file that differs is sent to
it again, once), each receiver what it got.
"""

from __future__ import annotations

import base64
import errno
import fnmatch
import hashlib
import json
import os
import posixpath
import shlex
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .errors import HostError, Location, OrchError, RemoteTimeout, SpecError
from .fanout import Outcome, Results
from .hostlayout import PY
from .launchers import launcher
from .logins import HOST_KEX, ssh_args
from .model import Cluster, Host, SshSettings
from .transport import Transport

DEFAULT_EXCLUDES = (".git/", "__pycache__/", "*.pyc", ".orch/")
IGNORE_FILES = (".orchignore", ".gitignore")
SAFE_MODE = 0o7755        # never group/other-writable on the hosts
CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    rel: str                   # posix path relative to workdir
    kind: str                  # file | dir | link
    mode: int = 0o644
    size: int = 0
    mtime_ns: int = 0
    local: Path | None = None  # the file here (kind file)
    target: str = ""           # kind link
    data: bytes | None = None  # a rendered file (no local path): compared by sha256
    sha256: str | None = None  # filled by manifest(hashed=True) and for rendered files


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- excludes


@dataclass(frozen=True)
class _Rule:
    glob: str
    negate: bool
    anchored: bool
    dir_only: bool


def parse_patterns(lines) -> list[_Rule]:
    """gitignore-style lines -> rules (comments and blanks skipped)."""
    rules = []
    for raw in lines:
        line = raw.rstrip("\n").rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        line = line.lstrip("/")
        if line.startswith("**/"):
            line, anchored = line[3:], "/" in line[3:]
        if line:
            rules.append(_Rule(line, negate, anchored, dir_only))
    return rules


def excluded(rules: list[_Rule], rel: str, is_dir: bool) -> bool:
    """Whether `rel` (relative to the synced directory) is left out: the last matching rule wins."""
    out = False
    name = rel.rsplit("/", 1)[-1]
    for r in rules:
        if r.dir_only and not is_dir:
            continue
        if fnmatch.fnmatchcase(rel if r.anchored else name, r.glob):
            out = not r.negate
    return out


# --------------------------------------------------------------------------- manifest


def manifest(base: Path, sync: tuple[str, ...], cluster_file: str, exclude: tuple[str, ...] = (),
             hashed: bool = False) -> list[Entry]:
    """Everything under the `sync` paths (relative to `base`), in a stable order: the directories
    (parents first), then the files and links."""
    entries: dict[str, Entry] = {}
    problems: list[tuple[Location, str]] = []
    base = base.resolve()
    for i, item in enumerate(sync):
        loc = Location(cluster_file, None, f"job.sync[{i}]")
        given = Path(item).expanduser()
        src = given if given.is_absolute() else base / given
        if not given.is_absolute() and not _inside(os.path.normpath(src), str(base)):
            problems.append((loc, f"{item!r} leaves the cluster file's directory {base}; write it as an "
                                  "absolute path if you mean to sync it"))
            continue
        src = Path(os.path.normpath(src))
        if not os.path.lexists(src):
            problems.append((loc, f"{item!r} does not exist (looked for {src})"))
            continue
        real = src.resolve()  # a link named in job.sync itself is what the user asked for: follow it
        if not real.exists():
            problems.append((loc, f"{item!r} is a broken link (to {os.readlink(src)})"))
            continue
        # `sync: ["."]` (or the cluster file's own directory): its contents land at workdir's top
        top = "" if real.is_dir() and real == base else src.name
        if real.is_dir():
            rules = parse_patterns(DEFAULT_EXCLUDES + tuple(exclude))
            for ig in IGNORE_FILES:
                if (real / ig).is_file():
                    rules += parse_patterns((real / ig).read_text(errors="replace").splitlines())
                    break
            _walk(real, top, rules, entries, problems, loc, hashed)
        else:
            entries[top] = _file_entry(real, top, hashed)
    if problems:
        raise SpecError(problems, hint="fix job.sync (or job.sync_exclude), or the files")
    # every directory before any file (parents first): a host then makes the whole tree before it
    # writes a file. Interleaved (a directory, its files, the next directory), 8 receivers making
    # 3,000 files spent 3x the kernel time of rsync in ext4's inode allocation on the lab's disk
    # (15-17 s against 5.5-6); directories first, 5.0 s
    ordered = sorted(entries)
    return [entries[k] for k in ordered if entries[k].kind == "dir"] + \
        [entries[k] for k in ordered if entries[k].kind != "dir"]


def job_manifest(cluster: Cluster) -> list[Entry]:
    """What `orch up` syncs of this cluster's job (job.sync less job.sync_exclude, less what
    set_aside leaves out): made once per `orch up`, for its probe's listing, the files check and
    the sync itself."""
    return job_files(cluster)[0]


def job_files(cluster: Cluster) -> tuple[list[Entry], list[Entry]]:
    """(job_manifest, the synced paths set_aside leaves out for this cluster's launcher)."""
    return set_aside(manifest(cluster.base_dir, cluster.job.sync, str(cluster.path), cluster.job.sync_exclude),
                     launcher(cluster).rendered_names(cluster))


def set_aside(entries: Sequence[Entry], names: Sequence[str]) -> tuple[list[Entry], list[Entry]]:
    """(entries to sync, the ones of `names` among those left out), pure: an entry that is one of
    `names` is left out and, for a directory, what is under it. `names`: the files orch writes in
    the workdir for the launch (a launcher's rendered_names: mpirun's hostfile, the rank table).
    Orch's is the one the launch reads there; a synced one of the same name (a hostfile left from running mpirun by hand, in
    a synced `.`) would be written to the same path in the same stream, and sent again on every
    `orch up` (each differs from what the other left)."""
    keep: list[Entry] = []
    out: list[Entry] = []
    for e in entries:
        if e.rel in names:
            out.append(e)
        elif not any(e.rel.startswith(n + "/") for n in names):
            keep.append(e)
    return keep, out


def set_aside_message(out: Sequence[Entry]) -> str | None:
    """The warning for what set_aside left out (each path once), or None."""
    tops = {e.rel: e for e in out}
    if not tops:
        return None
    shown = ", ".join(rel + ("/" if e.kind == "dir" else "") for rel, e in tops.items())
    one = len(tops) == 1
    return (f"job.sync: {shown} not synced: orch writes the launch's own {'file' if one else 'files'} of "
            f"{'that name' if one else 'those names'} in job.workdir (to keep this quiet: rename yours, or "
            f"leave {'it' if one else 'them'} out of job.sync, or add {', '.join('/' + r for r in tops)} to "
            "job.sync_exclude)")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _file_entry(path: Path, rel: str, hashed: bool, st: os.stat_result | None = None) -> Entry:
    st = st or path.stat()
    return Entry(rel, "file", st.st_mode & SAFE_MODE, st.st_size, st.st_mtime_ns, local=path,
                 sha256=_digest_of(path, st.st_size, st.st_mtime_ns) if hashed else None)


def _walk(root: Path, top: str, rules: list[_Rule], entries: dict, problems: list, loc: Location,
          hashed: bool) -> None:
    st = root.stat()
    if top:
        entries[top] = Entry(top, "dir", st.st_mode & SAFE_MODE)
    under = (lambda rel: f"{top}/{rel}") if top else (lambda rel: rel)
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: links are entries, not walked
        d = Path(dirpath)
        reld = d.relative_to(root).as_posix()
        keep = []
        for name in sorted(dirnames):
            p = d / name
            rel = f"{reld}/{name}" if reld != "." else name
            if p.is_symlink():
                filenames.append(name)  # a link to a directory: kept as a link, never walked
                continue
            if excluded(rules, rel, True):
                continue
            keep.append(name)
            entries[under(rel)] = Entry(under(rel), "dir", p.stat().st_mode & SAFE_MODE)
        dirnames[:] = keep
        for name in sorted(filenames):
            p = d / name
            rel = f"{reld}/{name}" if reld != "." else name
            try:
                lst = p.lstat()
            except OSError as exc:
                problems.append((loc, f"cannot read {p}: {exc.strerror}"))
                continue
            if stat.S_ISLNK(lst.st_mode):
                if excluded(rules, rel, False):
                    continue
                target = os.readlink(p)
                landing = os.path.realpath(os.path.join(d, target))  # as the kernel resolves it, links and all
                if os.path.isabs(target) or not _inside(landing, str(root)):
                    problems.append((loc, f"{p} is a link to {target}, outside the synced directory {root}: "
                                          "copy what it points to into the tree, exclude it, or sync its "
                                          "target itself"))
                    continue
                try:
                    os.stat(p)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        problems.append((loc, f"{p} is a symbolic link loop (-> {target}): remove or exclude it"))
                        continue  # a dangling link (ENOENT) is kept as it is, like rsync -a
                entries[under(rel)] = Entry(under(rel), "link", 0o777, target=target)
            elif stat.S_ISREG(lst.st_mode):
                if not excluded(rules, rel, False):
                    entries[under(rel)] = _file_entry(p, under(rel), hashed, lst)
            elif not excluded(rules, rel, False):
                problems.append((loc, f"{p} is not a regular file, directory or link (a socket, fifo or "
                                      "device): exclude it"))


def rendered(files: Mapping[str, bytes], made: dict[tuple[str, bytes], Entry] | None = None) -> list[Entry]:
    """Files orch renders (hostfile, rank table) as entries: compared by sha256. `made`: entries
    made before, kept across hosts (a rank table is every host's: 185 KB at 128 x 8, hashed once,
    not 128 times; hashlib lets go of the GIL for each, and got it back behind the supervisors'
    starts running meanwhile)."""
    made = {} if made is None else made
    out = []
    for rel, data in sorted(files.items()):
        e = made.get((rel, data))
        if e is None:
            e = made[(rel, data)] = Entry(rel, "file", 0o644, len(data), 0, data=data,
                                          sha256=hashlib.sha256(data).hexdigest())
        out.append(e)
    return out


# --------------------------------------------------------------------------- the host's side

# RECEIVER runs on the host with python3 (>= 3.8, stdlib): `list WORKDIR` (LISTER; the request and
# the answer in lines, see list_input and parse_listing), `recv WORKDIR` (the framed stream on
# stdin) and `relay WORKDIR` (pass on from this host to others, see cmd_relay; one JSON answer).
# Exit 41: cannot create workdir; 42: not writable; 43: a problem with one path (stderr: a JSON
# {"path", "error"}). The listing imports no json: json's import is `re` and its compiled
# patterns, 7 ms of CPU on every host, every `orch up` (the lister's whole start is ~9).
_RX_IMPORTS = "import errno, os, stat, sys\n"
_RX_HEAD = _RX_IMPORTS + "MODE, W = sys.argv[1], sys.argv[2]\n"
_RX_BASE = r'''
TMP = ".orch-sync-partial."
DIRS = {}

def fail(code, path, msg):
    import json
    sys.stderr.write(json.dumps({"path": path, "error": msg}) + "\n")
    sys.exit(code)

def split(rel):
    parts = [p for p in rel.split("/") if p]
    return "/".join(parts[:-1]), parts[-1]

def dirfd(rel, create=True):
    # The directory rel (below W) as an fd, reached component by component without following a
    # link (openat + O_NOFOLLOW): nothing lands through a link or file someone planted.
    if rel in DIRS:
        return DIRS[rel]
    if len(DIRS) > 256:
        for k in [k for k in DIRS if k]:
            os.close(DIRS.pop(k))
    parent, name = split(rel)
    pfd = dirfd(parent, create)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(name, flags, dir_fd=pfd)
    except FileNotFoundError:
        if not create:
            raise
        os.mkdir(name, 0o755, dir_fd=pfd)
        fd = os.open(name, flags, dir_fd=pfd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            link = stat.S_ISLNK(os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode)
            fail(43, rel, "%s/%s is %s, not a directory orch made: remove it" % (
                W, rel, "a symbolic link" if link else "a file"))
        raise
    DIRS[rel] = fd
    return fd

def start():
    if MODE == "list" and not os.path.lexists(W):  # nothing there yet: nothing to list, nothing made
        n = len(requested())
        sys.stdout.write("orch:list %d\n" % n + "-\n" * n)
        sys.exit(0)
    try:
        os.makedirs(W, 0o755, exist_ok=True)
    except OSError as e:
        fail(41, W, e.strerror)
    if not os.access(W, os.W_OK):
        fail(42, W, "not writable")
    DIRS[""] = os.open(W, os.O_RDONLY | os.O_DIRECTORY)

def small_sha256():
    # the listing hashes the rendered files alone (a hostfile, a rank table): CPython own C
    # sha256, not the one of hashlib, which loads OpenSSL: ~3 ms of CPU on every host, every up
    try:
        from _sha256 import sha256   # python <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256   # 3.12+
        except ImportError:
            from hashlib import sha256
    return sha256()

def requested():
    # the request: a line a path, "s PATH" (its stat) or "h PATH" (and its sha256); "S HEX", "H HEX":
    # the bytes of the path (UTF-8) in hex: a path with a newline, a control or an undecodable byte
    out = []
    for line in sys.stdin.buffer.read().decode("utf-8", "surrogateescape").split("\n"):
        if line[1:2] == " " and line[:1] in ("s", "h", "S", "H"):
            rel = line[2:]
            if line[0] in "SH":
                rel = bytes.fromhex(rel).decode("utf-8", "surrogateescape")
            out.append((rel, line[0] in "hH"))
    return out

def cmd_list():
    # the answer: "orch:list N", then a line a requested path: "-" (nothing there, or not to be
    # reached without a link), or "KIND SIZE MTIME_NS MODE EXTRA"; EXTRA "-", the sha256 of a file
    # asked for one, the target of a link (its UTF-8 bytes in hex)
    out = []
    for rel, want_hash in requested():
        try:
            parent, name = split(rel)
            d = dirfd(parent, create=False)
            st = os.stat(name, dir_fd=d, follow_symlinks=False)
        except (OSError, SystemExit):
            out.append("-")
            continue
        kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else \
            "file" if stat.S_ISREG(st.st_mode) else "other"
        extra = "-"
        try:   # changed since, or unreadable: as good as not there (sync sends it, and says why not)
            if kind == "link":
                extra = os.readlink(name, dir_fd=d).encode("utf-8", "surrogateescape").hex()
            elif kind == "file" and want_hash:
                h = small_sha256()
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
                with os.fdopen(fd, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                extra = h.hexdigest()
        except OSError:
            out.append("-")
            continue
        out.append("%s %d %d %d %s" % (kind, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), extra))
    sys.stdout.write("orch:list %d\n" % len(out) + "".join(x + "\n" for x in out))
'''

_RX_SEND = r'''
import hashlib, json

def readline(inp, rel):
    line = inp.readline()
    if not line.endswith(b"\n"):
        raise EOFError(rel)
    return line

def tmp_name():
    # a name below a directory for a file on its way (removed or renamed before the program ends)
    return TMP + os.urandom(6).hex()

def place(d, tmp, name, rel):
    # one rename, no stat of the name first (a syscall a file on every host): what is there is
    # replaced, a link itself, never what it points to; only a rename that failed looks at what
    # is there (a directory: EISDIR, or EPERM/EBUSY first where the kernel checks those first)
    try:
        os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
    except OSError:
        try:
            there = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
        except OSError:
            there = 0
        if stat.S_ISDIR(there):
            fail(43, rel, "%s/%s is a directory on this host; remove it" % (W, rel))
        raise

def writeall(fd, block):
    view = memoryview(block)
    while view:
        view = view[os.write(fd, view):]

def recv(inp, tee=None):
    # The stream on inp into W; with a tee (cmd_relay), every file's bytes are offered, as they are
    # written, to the threads passing it on.
    done = 0
    tmp = None
    rel = "(header)"
    modes = []
    frame = getattr(inp, "frame", None)  # a Spool's
    try:
        while True:
            if frame:
                frame()
            h = json.loads(readline(inp, rel))
            kind, rel = h.get("kind"), h.get("rel")
            if kind == "end":
                for rel, mode in reversed(modes):
                    os.fchmod(dirfd(rel), mode)
                break
            if kind == "dir":
                dirfd(rel)
                modes.append((rel, h["mode"]))  # set last: a 0555 directory must take its files first
                done += 1
                continue
            parent, name = split(rel)
            d = dirfd(parent)
            if kind == "chmod":
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=d)
                os.fchmod(fd, h["mode"])
                os.utime(fd, ns=(h["mtime"], h["mtime"]))
                os.close(fd)
            elif kind == "link":
                tmp = (d, tmp_name())
                os.symlink(h["target"], tmp[1], dir_fd=d)
                place(d, tmp[1], name, rel)
                tmp = None
            elif kind == "file":
                tmp = (d, tmp_name())
                fd = os.open(tmp[1], os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
                left, sha = h["size"], hashlib.sha256()
                if tee:
                    tee.start(rel, fd)
                try:
                    while left:
                        block = inp.read(min(left, 1 << 20))
                        if not block:
                            raise EOFError(rel)
                        sha.update(block)
                        writeall(fd, block)
                        left -= len(block)
                        if tee:
                            tee.grew(rel, h["size"] - left)
                    if readline(inp, rel).strip().decode() != sha.hexdigest():
                        fail(43, rel, "sha256 mismatch: what arrived is not what the controller listed "
                             "(changed while it was sent, or damaged on the way); run again")
                    os.fchmod(fd, h["mode"])
                    if h.get("mtime"):
                        os.utime(fd, ns=(h["mtime"], h["mtime"]))
                finally:
                    os.close(fd)
                place(d, tmp[1], name, rel)
                tmp = None
                if tee:
                    tee.placed(rel)
            done += 1
    except EOFError as e:
        fail(43, str(e), "the stream ended before it was complete (interrupted); nothing partial was kept")
    except OSError as e:
        fail(43, rel, e.strerror or str(e))
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp[1], dir_fd=tmp[0])
            except OSError:
                pass
    return done

def stream():
    # stdin, read in large pieces: the pipe from sshd made 1 MB where the kernel lets this user
    # (F_SETPIPE_SZ), read 64 KB at a time (sys.stdin.buffer reads 8 KB): fewer reads and wake-ups,
    # ~8% less CPU for a receiver of 3,000 small files
    try:
        import fcntl
        fcntl.fcntl(0, 1031, 1 << 20)  # F_SETPIPE_SZ
    except (ImportError, OSError):
        pass
    return open(0, "rb", buffering=1 << 16, closefd=False)

def cmd_recv():
    print(json.dumps({"written": recv(stream())}))

def open_below(rel):
    # A file below W for reading, reached without following a link, without the DIRS cache
    # (recv uses it at the same time)
    parts = [p for p in rel.split("/") if p]
    fd = os.open(W, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)

class Tee:
    # The files this host receives while it passes them on: each target's thread reads a file's
    # bytes from this host's temp file as they are written (no copy held in memory), from the file
    # in its place once it is whole. A file's descriptor is held here only while it arrives, and
    # by each thread only while it passes that file on: a tree of more files than the host's limit
    # of open files (1024 is common) passes as any other
    def __init__(self, wanted):
        import threading
        self.cv = threading.Condition()
        self.wanted, self.files, self.failed = wanted, {}, False  # files: {rel: [fd, or None once placed; bytes]}

    def start(self, rel, fd):
        if rel in self.wanted:
            with self.cv:
                self.files[rel] = [os.dup(fd), 0]
                self.cv.notify_all()

    def grew(self, rel, n):
        f = self.files.get(rel)
        if f is not None:
            with self.cv:
                f[1] = n
                self.cv.notify_all()

    def placed(self, rel):
        f = self.files.get(rel)
        if f is not None:
            with self.cv:
                os.close(f[0])
                f[0] = None
                self.cv.notify_all()

    def fail(self):
        with self.cv:
            self.failed = True
            self.cv.notify_all()

    def follow(self, rel, size, write, deadline):
        import time
        off, fd = 0, None
        try:
            while off < size:
                with self.cv:
                    while not self.failed and (rel not in self.files or
                                               (self.files[rel][0] is not None and self.files[rel][1] <= off)):
                        if time.monotonic() > deadline:
                            raise OSError(errno.ETIMEDOUT, "%s did not arrive here in time" % rel)
                        self.cv.wait(1)
                    if self.failed:
                        raise OSError(errno.EIO, "this host's own copy failed")
                    held, n = self.files[rel]
                    if fd is None:
                        fd = os.dup(held) if held is not None else open_below(rel)
                    if held is None:
                        n = size
                while off < n:
                    block = os.pread(fd, min(n - off, 1 << 20), off)
                    if not block:
                        raise OSError(errno.EIO, "%s/%s shrank on this host while it was passed on" % (W, rel))
                    write(block)
                    off += len(block)
        finally:
            if fd is not None:
                os.close(fd)

    def close(self):
        for fd, _ in self.files.values():
            if fd is not None:
                os.close(fd)

def spool_file():
    # a file of this host's, in W, that no one else can open: unnamed (O_TMPFILE), else named for
    # a moment (created exclusively, mode 0600, then unlinked)
    d = dirfd("")
    try:
        return os.open(".", os.O_RDWR | os.O_TMPFILE, 0o600, dir_fd=d)
    except (AttributeError, OSError):
        name = tmp_name()
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=d)
        os.unlink(name, dir_fd=d)
        return fd

class Spool:
    # This host's own stream, kept as recv reads it (through this) in a spool_file, for the targets
    # that lack just what its first CUT frames carry (the controller puts what only this host lacks
    # after them): each is sent these same bytes (the frames, the controller's sha256 trailers) from
    # where it has got to, by the kernel (sendfile), a stretch at a time, then an end frame: no
    # Python a file, no waking a thread a file. Nothing past the cut is kept.
    STEP = 1 << 18

    def __init__(self, inp, cut):
        import threading
        self.inp, self.cv, self.buf, self.fd = inp, threading.Condition(), bytearray(), spool_file()
        self.size, self.ended = 0, None  # bytes in the file; ended: True once it is whole, False: it failed
        self.frames, self.cut_at, self.cut = 0, cut, None  # frames begun; the offset of frame CUT's start

    def frame(self):
        # recv begins a frame
        if self.frames == self.cut_at:
            self.flush()
            with self.cv:
                self.cut = self.size
                self.cv.notify_all()
        self.frames += 1

    def keep(self, data):
        if self.cut is None:
            self.buf += data
            if len(self.buf) >= self.STEP:
                self.flush()
        return data

    def readline(self):
        return self.keep(self.inp.readline())

    def read(self, n=-1):
        return self.keep(self.inp.read(n))

    def flush(self):
        buf, self.buf = self.buf, bytearray()
        writeall(self.fd, buf)
        with self.cv:
            self.size += len(buf)
            self.cv.notify_all()

    def end(self, ok):
        if ok:
            self.flush()
        with self.cv:
            self.ended = ok
            self.cv.notify_all()

    def follow(self, out, end, deadline):
        import time
        out.flush()
        w, off = out.fileno(), 0
        while True:
            with self.cv:
                while self.ended is None and self.size <= off and (self.cut is None or off < self.cut):
                    if time.monotonic() > deadline:
                        raise OSError(errno.ETIMEDOUT, "this host's own stream did not arrive in time")
                    self.cv.wait(1)
                if self.ended is False and (self.cut is None or self.size < self.cut):
                    raise OSError(errno.EIO, "this host's own copy failed")
                if self.ended and self.cut is None:
                    raise OSError(errno.EIO, "this host's own stream had fewer frames than the controller said")
                n = self.size if self.cut is None else min(self.size, self.cut)
            while off < n:
                try:
                    sent = os.sendfile(w, self.fd, off, n - off)
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.ENOSYS):
                        raise
                    sent = os.write(w, os.pread(self.fd, min(n - off, 1 << 20), off))
                if not sent:
                    raise OSError(errno.EIO, "the spool of this host's own stream ended early")
                off += sent
            if self.cut is not None and off >= self.cut:
                writeall(w, end)
                return

    def close(self):
        os.close(self.fd)

def cmd_relay():
    # This host receives its own stream (recv, after the request) and passes on to others what they
    # lack: what arrives as it arrives (Tee), the rest from its own copy (quick-checked against the
    # controller's list, its sha256 checked here). Request (one JSON line on stdin): "entries"
    # [rel, kind, mode, size, mtime, sha256 | link target, blob key or None], "blobs" (rendered
    # files, base64), "targets" [{name, argv (ssh to it), workdir, items [[entry index, what]]}], "code"
    # (this script), "py", "timeout" (seconds for all), "fanout", "ssh_options", "incoming" (the
    # files in this host's own stream that targets want file by file); "raw": a target with "raw"
    # lacks just what the first "raw" frames of this host's own stream carry: it gets them as they
    # came (Spool). Each target runs
    # `recv` and checks every file against the controller's sha256 (each file's trailer).
    import base64, shlex, subprocess, threading, time
    inp = stream()
    req = json.loads(inp.readline())
    ents, targets = req["entries"], req["targets"]
    blobs = {k: base64.b64decode(v) for k, v in req["blobs"].items()}
    deadline = time.monotonic() + req["timeout"]
    tee = Tee(set(req["incoming"]))  # what arrives on stdin for this host (recv) while it is passed on

    # the first hop's check: this host's copy of every file it passes on (and does not receive
    # now: recv checks those) has the controller's sha256
    bad = {}
    for i in sorted({i for t in targets for i, what in t["items"] if what == "send"}):
        rel, kind, mode, size, mtime, extra, blob = ents[i]
        if kind != "file" or blob or rel in tee.wanted:
            continue
        try:
            h, n = hashlib.sha256(), 0
            with os.fdopen(open_below(rel), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    n += len(block)
            if h.hexdigest() != extra:
                bad[rel] = "its sha256 is not the controller's (%d bytes here, %d sent)" % (n, size)
        except OSError as e:
            bad[rel] = "cannot read it: %s" % (e.strerror or e)
    # ssh's costs on this host: curve25519 first (OpenSSH >= 9 opens with sntrup761, ~0.15 s of CPU a
    # connection), AES-GCM first where the CPU has AES instructions (faster than chacha20 there);
    # an ssh that does not know `^` (< 8.2) keeps its defaults
    opts = []
    for opt in req.get("ssh_options") or ():
        if opt.startswith("Ciphers="):
            try:
                with open("/proc/cpuinfo") as fh:
                    if " aes" not in fh.read():
                        continue
            except OSError:
                continue
        try:
            if subprocess.run(["ssh", "-G", "-o", opt, "localhost"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
                opts += ["-o", opt]
        except (OSError, subprocess.TimeoutExpired):
            pass
    results = {}
    slots = threading.Semaphore(max(1, req["fanout"]))

    def hdr(**f):
        return json.dumps(f, separators=(",", ":")).encode() + b"\n"

    def frames(w, e, what):
        rel, kind, mode, size, mtime, extra, blob = e
        if what == "chmod":
            w.write(hdr(kind="chmod", rel=rel, mode=mode, mtime=mtime))
        elif kind == "dir":
            w.write(hdr(kind="dir", rel=rel, mode=mode))
        elif kind == "link":
            w.write(hdr(kind="link", rel=rel, target=extra))
        else:
            w.write(hdr(kind="file", rel=rel, mode=mode, size=size, mtime=mtime))
            if blob:
                w.write(blobs[blob])
            elif rel in tee.wanted:
                tee.follow(rel, size, w.write, deadline)
            else:
                left = size
                with os.fdopen(open_below(rel), "rb") as fh:
                    while left:
                        block = fh.read(min(left, 1 << 20))
                        if not block:
                            raise OSError(errno.EIO, "%s/%s shrank on this host while it was passed on" % (W, rel))
                        w.write(block)
                        left -= len(block)
            w.write(extra.encode() + b"\n")  # the controller's sha256: the receiver checks against it

    def send(t):
        with slots:
            out = {"rc": None, "out": "", "err": "", "expired": False}
            results[t["name"]] = out
            if time.monotonic() >= deadline:
                out["expired"] = True
                return
            try:
                remote = " ".join(shlex.quote(a) for a in req["py"] + ["-c", req["code"], "recv", t["workdir"]])
                p = subprocess.Popen(t["argv"][:1] + opts + t["argv"][1:] + [remote], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            except OSError as e:
                out.update(rc=127, err=str(e))
                return

            def kill():
                try:
                    os.killpg(p.pid, 9)  # ssh and whatever it started here
                except OSError:
                    pass

            def expire():
                out["expired"] = True
                kill()
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
            timer.start()
            got = {}
            readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()))
                       for k, f in (("out", p.stdout), ("err", p.stderr))]
            for r in readers:
                r.start()
            try:
                if t.get("raw"):
                    spool.follow(p.stdin, hdr(kind="end"), deadline)
                else:
                    for i, what in t["items"]:
                        frames(p.stdin, ents[i], what)
                    p.stdin.write(hdr(kind="end"))
                p.stdin.close()
            except BrokenPipeError:
                pass  # the receiver stopped: its exit code and stderr say why
            except OSError as e:  # this side cannot go on: the receiver sees its stream end, keeps nothing
                out["err"] = str(e.strerror or e)
                try:
                    p.stdin.close()
                except OSError:
                    pass
            rc = p.wait()
            timer.cancel()
            for r in readers:
                r.join(10)
            out.update(rc=rc, out=got.get("out", b"").decode("utf-8", "replace")[-2000:],
                       err=(out["err"] + "\n" + got.get("err", b"").decode("utf-8", "replace")).strip()[-2000:])

    spool = Spool(inp, req["raw"]) if not bad and any(t.get("raw") for t in targets) else None
    threads = [] if bad else [threading.Thread(target=send, args=(t,)) for t in targets]
    for th in threads:
        th.start()
    try:
        written = recv(spool or inp, tee)
        if spool:
            spool.end(True)
    except BaseException:  # this host's own copy failed (stderr says why, if the controller still
        tee.fail()         # listens: it may be gone): stop passing it on; the receivers keep nothing
        if spool:
            spool.end(False)
        for th in threads:
            th.join()
        raise
    for th in threads:
        th.join()
    tee.close()
    if spool:
        spool.close()
    print(json.dumps({"written": written, "bad": bad, "targets": results, "spooled": spool.size if spool else 0}))

start()
{"list": cmd_list, "recv": cmd_recv, "relay": cmd_relay}[sys.argv[1]]()
'''
RECEIVER = _RX_HEAD + _RX_BASE + _RX_SEND
# `list` alone (every host, every `orch up`): a quarter of the program for python to compile,
# which it does anew on each start of a `-c` program (3.4 ms of CPU for the whole, 0.7 ms for this)
LISTER = _RX_HEAD + _RX_BASE + "\nstart()\ncmd_list()\n"
# ... and at the end of another `python3 -S` program that runs on the host anyway (up's reach
# test: one python3 start fewer a host, ~7 ms of CPU): the workdir from the environment
# (LIST_ENV), the request on stdin; it prints its answer or nothing, and never raises (a workdir
# it cannot use: its error line, and no answer: sync lists that host itself and says why)
LIST_ENV = "ORCH_LIST_W"
LIST_INSIDE = (_RX_IMPORTS + f'MODE, W = "list", os.environ.pop("{LIST_ENV}")\n' + _RX_BASE
               + "\ntry:\n    start()\n    cmd_list()\nexcept (Exception, SystemExit):\n    pass\n"
               "sys.stdout.flush()\n")


def _receiver_argv(mode: str, workdir: str) -> list[str]:
    return [*PY, "-c", LISTER if mode == "list" else RECEIVER, mode, workdir]  # stdlib only: no site


# --------------------------------------------------------------------------- the controller's side


@dataclass(frozen=True)
class SyncReport:
    host: str
    copied: tuple[str, ...]
    unchanged: tuple[str, ...]
    resent: tuple[str, ...] = ()  # the launch host's copies that were not what it listed: sent again


def _differs(e: Entry, have: list | None) -> str | None:
    """What must be sent for `e` given the host's record of it: None (nothing), "chmod", "send"."""
    if have is None:
        return "send"
    kind, size, mtime, mode, extra = have
    if kind != e.kind:
        return "send"
    if e.kind == "dir":
        return None if mode == e.mode else "send"
    if e.kind == "link":
        return None if extra == e.target else "send"
    if e.data is not None:
        return None if extra == e.sha256 and mode == e.mode else "send"
    if size != e.size or mtime != e.mtime_ns:
        return "send"
    return None if mode == e.mode else "chmod"


class SyncSourceError(OrchError):
    """A local file changed or vanished while it was being sent."""


class _Frames:
    """A file-like view of the stream (read(n)), produced as it is read: headers, bytes, trailers."""

    def __init__(self, items: list[tuple[Entry, str]], prefix: bytes = b""):
        self._gen = self._frames(items)
        self._buf = bytearray(prefix)  # the relay's request line, before the frames
        self._pos = 0

    @staticmethod
    def _frames(items) -> Iterator[bytes]:
        for e, what in items:
            if what == "chmod":
                yield _header(kind="chmod", rel=e.rel, mode=e.mode, mtime=e.mtime_ns)
            elif e.kind == "dir":
                yield _header(kind="dir", rel=e.rel, mode=e.mode)
            elif e.kind == "link":
                yield _header(kind="link", rel=e.rel, target=e.target)
            elif e.data is not None:
                yield _header(kind="file", rel=e.rel, mode=e.mode, size=len(e.data), mtime=0)
                yield e.data
                yield (e.sha256 or "").encode() + b"\n"
            else:
                assert e.local is not None
                yield _header(kind="file", rel=e.rel, mode=e.mode, size=e.size, mtime=e.mtime_ns)
                left = e.size
                try:
                    digest = _digest(e)  # once for every host; the host checks what it got against it
                    with open(e.local, "rb") as fh:
                        while left:
                            block = fh.read(min(left, CHUNK))
                            if not block:
                                break
                            left -= len(block)
                            yield block
                except OSError as exc:
                    raise SyncSourceError(f"cannot read {e.local}: {exc.strerror}") from None
                if left:
                    raise SyncSourceError(f"{e.local} shrank while it was being sent; run again")
                yield digest.encode() + b"\n"
        yield _header(kind="end")

    def read(self, n: int = -1) -> bytes:
        """Up to n bytes (all with n < 0); b"" at the end. Small frames are gathered into one
        read; the buffer is consumed by an offset, never copied whole per read."""
        while n < 0 or len(self._buf) - self._pos < n:
            try:
                chunk = next(self._gen)
            except StopIteration:
                break
            if self._pos:
                del self._buf[:self._pos]
                self._pos = 0
            self._buf += chunk
        end = len(self._buf) if n < 0 else min(len(self._buf), self._pos + n)
        out = bytes(self._buf[self._pos:end])
        self._pos = end
        return out


_DIGESTS: dict[tuple, str] = {}
_DIGESTS_LOCK = threading.Lock()


def _digest(e: Entry) -> str:
    """sha256 of a local file as listed (path, size, mtime), computed once for every host."""
    if e.sha256:
        return e.sha256
    assert e.local is not None  # an entry without its digest is a local file
    return _digest_of(e.local, e.size, e.mtime_ns)


def _digest_of(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of a local file, computed once per (path, size, mtime) in this process: `orch up`'s
    check plan (manifest(hashed=True)) and its sync both need it."""
    key = (str(path), size, mtime_ns)
    with _DIGESTS_LOCK:
        got = _DIGESTS.get(key)
    if got is None:
        got = _sha256(path)
        with _DIGESTS_LOCK:
            _DIGESTS[key] = got
    return got


def _header(**fields) -> bytes:
    return json.dumps(fields, separators=(",", ":")).encode() + b"\n"


def _host_error(host: Host, rc: int, out: str, err: str, workdir: str, what: str,
                hint: str | None = None) -> HostError:
    try:
        detail = json.loads(err.strip().splitlines()[-1])
        path, why = detail.get("path"), detail.get("error")
    except (ValueError, IndexError, AttributeError):
        path, why = None, (err.strip() or out.strip())[-300:]
    if rc == 41:
        return HostError(host.name, f"{what}: cannot create workdir {workdir}: {why}",
                         hint="check job.workdir and the user's permissions on the host")
    if rc == 42:
        return HostError(host.name, f"{what}: workdir {workdir} is not writable by {host.user}")
    where = f" {posixpath.join(workdir, path)}" if path and path != workdir else ""
    full = any(w in str(why) for w in ("No space", "Permission denied", "Read-only", "quota"))
    return HostError(host.name, f"{what}{where}: {why} (exit {rc})",
                     hint="is the disk full, or the directory not writable?" if full else hint)


# --------------------------------------------------------------------------- the listing in up's probe


LISTING_SECTION = "synclist"


def listing_request(entries: Sequence[Entry], rendered_names: Sequence[str] = ()) -> tuple[tuple[str, bool], ...]:
    """What `orch up`'s check probe lists on every host (the receiver's `list` request, pure): every
    synced path by its size and mtime, and the files orch renders (`rendered_names`: hostfile,
    rank table) by their sha256."""
    assert not {e.rel for e in entries} & set(rendered_names), "job_manifest sets them aside (set_aside)"
    return tuple([(e.rel, False) for e in entries] + [(n, True) for n in sorted(set(rendered_names))])


def list_input(request: Sequence[tuple[str, bool]]) -> str:
    """The receiver's `list` request (pure): a line a path, "s PATH" for its stat, "h PATH" for its
    sha256 too; a path that is not all printable (a newline, a control character, a byte that is
    not UTF-8, kept by surrogateescape) goes as "S HEX" / "H HEX", its bytes in hex. No line is the
    here-document's delimiter: each starts with its letter and a space."""
    lines = []
    for rel, want_hash in request:
        if rel.isprintable():
            lines.append(f"{'h' if want_hash else 's'} {rel}\n")
        else:
            lines.append(f"{'H' if want_hash else 'S'} {rel.encode('utf-8', 'surrogateescape').hex()}\n")
    return "".join(lines)


def list_heredoc(request: Sequence[tuple[str, bool]]) -> str:
    """The request as the listing's stdin in a shell script: a here-document (list_input), to end
    a command line."""
    return f"<<'ORCH_LIST_END'\n{list_input(request)}ORCH_LIST_END"


def listing_script(workdir: str, request: Sequence[tuple[str, bool]], wrap: str = "$T ") -> str:
    """The probe section's shell: the receiver's `list` with the request on stdin. Creates
    nothing on the host. `wrap`: what runs it (the probe's time limit; "" in prepare's round
    trip, which has the command's own)."""
    py = " ".join(shlex.quote(a) for a in _receiver_argv("list", workdir))
    return f"{wrap}{py} {list_heredoc(request)}"


_KINDS = ("file", "dir", "link", "other")


def _listed(line: str) -> list | None:
    """One line of the receiver's listing -> [kind, size, mtime_ns, mode, extra]; ValueError when
    it is not one."""
    if line == "-":
        return None
    kind, size, mtime, mode, extra = line.split(" ")
    if kind not in _KINDS:
        raise ValueError(kind)
    rec: list = [kind, int(size), int(mtime), int(mode), None]
    if extra != "-":
        rec[4] = bytes.fromhex(extra).decode("utf-8", "surrogateescape") if kind == "link" else extra
    return rec


def parse_listing(request: Sequence[tuple[str, bool]], text: str) -> dict[str, list | None] | None:
    """The section's output -> {path: the host's record of it, as the receiver lists it}; None when
    it is not a whole answer to `request` (sync then asks in its own round trip). Lines before
    the answer (a login banner, a path the receiver could not reach) are passed over."""
    lines = text.split("\n")
    head = f"orch:list {len(request)}"
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("orch:list "):
            body = lines[i + 1:i + 1 + len(request)]
            if lines[i] != head or len(lines) <= i + len(request) + 1:   # short, or its last line cut
                return None
            try:
                return {rel: _listed(line) for (rel, _), line in zip(request, body)}
            except ValueError:
                return None
    return None


def known_todo(items: Sequence[Entry], listed: Mapping[str, list | None] | None) -> list[tuple[Entry, str]] | None:
    """What to send of `items` by a listing the probe made (pure); None when it lacks one of
    them (a path added since, or no listing): then the host is asked. The listing may be stale:
    a local file edited since has another size or mtime now (sent); a stream is checked by
    sha256 on the host, so a stale listing costs a resend at most, never a wrong file."""
    if listed is None or any(e.rel not in listed for e in items):
        return None
    return [(e, what) for e in items if (what := _differs(e, listed[e.rel]))]


def _todo(t: Transport, workdir: str, items: list[Entry]) -> list[tuple[Entry, str]]:
    """The first round trip: what of `items` the host lacks (or has otherwise), and what to send."""
    request = [(e.rel, e.data is not None) for e in items]
    res = t.run(_receiver_argv("list", workdir), stdin=list_input(request).encode())
    if not res.ok:
        raise _host_error(t.host, res.exit_code, res.out, res.err, workdir, "cannot list")
    todo = known_todo(items, parse_listing(request, res.out))   # the probe's listing is read the same way
    if todo is None:
        raise HostError(t.host.name, f"unreadable answer from the sync receiver: {res.out[-200:]!r}")
    return todo


def _sent(todo: Sequence[tuple[Entry, str]]) -> int:
    """The bytes of the files a stream carries."""
    return sum(e.size for e, what in todo if what == "send")


def _stream_timeout(command_timeout: float, *todos: Sequence[tuple[Entry, str]]) -> float:
    """A stream's limit: the usual one, plus what it sends at 1 MB/s."""
    return command_timeout + sum(_sent(todo) for todo in todos) / 1e6


def _send(t: Transport, workdir: str, todo: list[tuple[Entry, str]], what: str = "cannot write") -> None:
    """The second round trip: one stream of `todo` from here."""
    if todo:
        res = t.run(_receiver_argv("recv", workdir), stdin=_Frames(todo), timeout=_stream_timeout(t.command_timeout, todo))
        if not res.ok:
            raise _host_error(t.host, res.exit_code, res.out, res.err, workdir, what)


def _report(host: Host, entries: list[Entry], todo: list[tuple[Entry, str]], resent: tuple[str, ...] = ()
            ) -> SyncReport:
    sent = {e.rel for e, _ in todo}
    synced = [e for e in entries if e.kind != "dir"]  # what the user syncs (not dirs, not rendered files)
    return SyncReport(host.name, tuple(e.rel for e in synced if e.rel in sent),
                      tuple(e.rel for e in synced if e.rel not in sent), resent)


def _todo_for(t: Transport, workdir: str, items: list[Entry], listed: Mapping[str, list | None] | None
              ) -> list[tuple[Entry, str]]:
    """What to send: by the probe's listing when it covers `items`, else by a listing round trip."""
    known = known_todo(items, listed)
    return known if known is not None else _todo(t, workdir, items)


def sync_host(t: Transport, workdir: str, entries: list[Entry], extra: dict[str, bytes] | None = None,
              listed: Mapping[str, list | None] | None = None) -> SyncReport:
    """Bring `workdir` on one host up to date with `entries`, plus `extra` rendered files
    ({relative path: bytes}): two round trips, one stream; one (the stream, when something
    differs) when `listed`, what up's probe listed there (parse_listing), covers them."""
    todo = _todo_for(t, workdir, entries + rendered(extra or {}), listed)
    _send(t, workdir, todo)
    return _report(t.host, entries, todo)


# --------------------------------------------------------------------------- through the launch host

RELAY_FANOUT = 16  # streams the launch host sends at once
# The hosts that lack what most hosts lack, all of which the launch host lacks too, get that part
# of the launch host's own stream as it came (raw_order; cmd_relay's Spool: the kernel copies it,
# no Python a file), which the launch host keeps, unlinked, in its workdir while it passes it on:
# up to this many bytes; more is passed on file by file, from the files themselves (where a file's
# own cost is small beside its bytes anyway)
RAW_MOST = 256 << 20
RELAY_CIPHERS = "Ciphers=^aes128-gcm@openssh.com,aes256-gcm@openssh.com"


def relayed(hosts: Sequence[Host], launch: Host, via: str) -> list[Host]:
    """The hosts that get the code from the launch host rather than from here (job.sync_via:
    launch-host): every other host reached by ssh. None when the launch host is this machine
    (connection: local), where the controller's link is not crossed anyway."""
    if via != "launch-host" or launch.connection != "ssh":
        return []
    return [h for h in hosts if h.name != launch.name and h.connection == "ssh"]


def raw_order(own: Sequence[tuple[Entry, str]], todos: Mapping[str, tuple[Host, Sequence[tuple[Entry, str]]]]
              ) -> tuple[list[tuple[Entry, str]], int]:
    """The launch host's own stream ordered for the hosts that get it as it came (pure): (its
    items, what most hosts lack first, then what only it lacks; how many items those hosts get:
    0 for none). Those hosts: the most of them that lack the same items, all of which the launch
    host lacks too (a first sync, an edit; what only it lacks: the hostfile), up to RAW_MOST bytes."""
    own = list(own)
    # the hosts' todos, each once, with how many hosts lack just that: compared as lists (the same
    # entries, so at once item by item), not hashed (3,000 entries' hashes a host: 73 ms of the
    # controller's CPU at 128 hosts)
    kinds: list[list] = []
    for todo in (list(todo) for _, todo in todos.values() if todo):
        for kind in kinds:
            if kind[0] == todo:
                kind[1] += 1
                break
        else:
            kinds.append([todo, 1])
    mine = set(own)
    for todo, _ in sorted(kinds, key=lambda k: -k[1]):   # stable: the first met of as many hosts first
        if mine.issuperset(todo) and _sent(todo) <= RAW_MOST:
            lacked = set(todo)
            return todo + [x for x in own if x not in lacked], len(todo)
    return own, 0


def relay_request(launch: Host, workdir: str, todos: Mapping[str, tuple[Host, list[tuple[Entry, str]]]], *,
                  connect_timeout: float, timeout: float, own: Sequence[tuple[Entry, str]] = (), raw: int = 0,
                  fanout: int = RELAY_FANOUT, share: str | None = None) -> dict:
    """The launch host's relay request (cmd_relay), pure: every entry once, rendered files once
    per content, each target with its ssh command (as mpirun reaches it: logins.ssh_args) and
    what it lacks; `own`: the launch host's own stream, which follows the request (the files in
    it are passed on as they arrive); `share`: the ControlPath of the launch host's open connections
    to the others (its mesh test's: probes.mesh_shared), used where one is open. `raw`: a host whose
    todo is `own`'s first `raw` items gets them as the launch host's stream carries them (raw_order)."""
    index: dict[tuple, int] = {}
    entries: list[list] = []
    blobs: dict[str, str] = {}
    targets = []
    shared = list(own[:raw]) if raw else None
    wanted: set[str] = set()  # what the hosts passed on to file by file want
    for name, (host, todo) in todos.items():
        items = []
        is_raw = todo == shared
        for e, what in () if is_raw else todo:
            if what == "send":
                wanted.add(e.rel)
            blob = None
            if e.data is not None:  # a rendered file: its content goes in the request, once
                blob = e.sha256 or hashlib.sha256(e.data).hexdigest()
                blobs.setdefault(blob, base64.b64encode(e.data).decode())
            key = (e.rel, e.kind, e.mode, e.size, e.mtime_ns, e.sha256, e.target, blob)
            if key not in index:
                index[key] = len(entries)
                extra = e.target if e.kind == "link" else (e.sha256 if e.data is not None else _digest(e)) \
                    if e.kind == "file" else None
                entries.append([e.rel, e.kind, e.mode, e.size, e.mtime_ns, extra, blob])
            items.append([index[key], what])
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, round(connect_timeout))}",
                *(["-o", f"ControlPath={share}"] if share else []), *ssh_args(launch, host), host.cluster_address]
        targets.append({"name": name, "argv": argv, "workdir": workdir, "items": items, "raw": is_raw})
    return {"entries": entries, "blobs": blobs, "targets": targets, "code": RECEIVER, "py": list(PY),
            "timeout": timeout, "fanout": fanout, "ssh_options": [HOST_KEX, RELAY_CIPHERS], "raw": raw,
            "incoming": sorted({e.rel for e, what in own if what == "send" and e.kind == "file" and e.data is None
                                and e.rel in wanted})}



def _relay_timeout(command_timeout: float, own, todos) -> float:
    """As a direct stream's: everything the relay carries, at 1 MB/s, on top of the usual limit."""
    return _stream_timeout(command_timeout, own, *(todo for _, todo in todos.values()))


def relay_errors(launch: Host, todos: Mapping[str, tuple[Host, list]], answer: Mapping, workdir: str,
                 timeout: float) -> dict[str, HostError]:
    """The relay's answer (cmd_relay) -> {host name: its error}, each naming the hop (pure)."""
    out: dict[str, HostError] = {}
    got = answer.get("targets") or {}
    for name, (host, _) in todos.items():
        r = got.get(name)
        hop = f"sync {launch.name} -> {name} (job.sync_via: launch-host)"
        if r is None:
            out[name] = HostError(name, f"{hop}: no answer from the relay on {launch.name}")
        elif r.get("expired"):
            out[name] = RemoteTimeout(name, f"{hop}: not done within {timeout:g}s (stopped)",
                                      hint=f"is the link from {launch.name} to {name} slow or stuck? "
                                           "job.sync_via: controller sends from here instead")
        elif r.get("rc") == 255 or r.get("rc") == 127:
            err = str(r.get("err") or "").strip().splitlines()
            out[name] = HostError(name, f"{hop}: ssh from {launch.name} failed: {err[-1] if err else 'exit 255'}",
                                  hint=f"{launch.name} must reach {name} by ssh without a password, as mpirun does "
                                       "(`orch check` tests it); or set job.sync_via: controller")
        elif r.get("rc") != 0:
            out[name] = _host_error(host, int(r.get("rc") or 1), str(r.get("out", "")), str(r.get("err", "")),
                                    workdir, f"{hop}: cannot write")
    return out


def _relay(t: Transport, workdir: str, own: list[tuple[Entry, str]], todos, ssh: SshSettings, hop: str,
           share: str | None = None) -> dict:
    """One request to the launch host: its own stream (`own`), and what it passes on (`todos`)."""
    timeout = _relay_timeout(ssh.command_timeout, own, todos)
    own, raw = raw_order(own, todos)
    req = relay_request(t.host, workdir, todos, connect_timeout=ssh.connect_timeout, timeout=timeout, own=own,
                        raw=raw, share=share)
    res = t.run(_receiver_argv("relay", workdir), stdin=_Frames(own, json.dumps(req).encode() + b"\n"),
                timeout=timeout + ssh.command_timeout)
    if not res.ok:
        raise _host_error(t.host, res.exit_code, res.out, res.err, workdir, f"{hop}: cannot write")
    try:
        answer = json.loads(res.out.strip().splitlines()[-1])
        assert isinstance(answer, dict)
    except (ValueError, IndexError, AssertionError):
        raise HostError(t.host.name, f"unreadable answer from the sync relay: {res.out[-200:]!r}") from None
    return answer


def sync_hosts(pool, hosts: Sequence[Host], launch: Host, workdir: str, entries: list[Entry],
               extras: Mapping[str, Mapping[str, bytes]], *, via: str, ssh: SshSettings,
               fan: Callable[[Sequence[Host], Callable[[Host], Any]], Results],
               listed: Mapping[str, Mapping[str, list | None]] | None = None, share: str | None = None) -> Results:
    """Bring every host's workdir up to date: {host name: Outcome(SyncReport)}.

    Every host lists what it has (its probe's listing, else here: one round trip, names only).
    job.sync_via: controller: each host is sent what it lacks from here, its own stream.
    launch-host: one request to the launch host carries what it lacks, and it passes on what each
    other host lacks (what arrives as it arrives, the rest from its own copy, checked against the
    controller's sha256), inside the cluster: the code crosses this machine's link once.

    `listed`: {host name: what up's check probe listed there} (parse_listing): a host it covers
    is not asked again. `share`: the launch host's open connections the relay's ssh uses
    (relay_request)."""
    listed = listed or {}
    made: dict[tuple[str, bytes], Entry] = {}
    items = {h.name: entries + rendered(extras.get(h.name, {}), made) for h in hosts}
    # what each host lacks by its listing, here: a host needs a thread of the fan-out only for a
    # round trip (the listing does not cover it, or something goes to it). With nothing to send
    # at 128 hosts, the fan-out's 128 threads took their turns at the GIL behind the supervisors'
    # starts (running meanwhile) for 0.05-0.6 s, and the head's start waits for the sync's end.
    known = {h.name: known_todo(items[h.name], listed.get(h.name)) for h in hosts}
    via_launch = relayed(hosts, launch, via)   # none: every host is sent its own stream from here (near)
    asked = fan([h for h in hosts if known[h.name] is None], lambda h: _todo(pool[h], workdir, items[h.name]))
    done: dict[str, Outcome] = {n: o for n, o in asked.items() if not o.ok}
    lacks: dict[str, list[tuple[Entry, str]]] = {
        h.name: (asked[h.name].value if h.name in asked else known[h.name]) or [] for h in hosts if h.name not in done}
    todos = {h.name: (h, lacks[h.name]) for h in via_launch if lacks.get(h.name)}
    hop = f"sync controller -> {launch.name} (the launch host, job.sync_via: launch-host)"
    # the launch host's own stream goes with the relay request when there is something to pass on
    near = [h for h in hosts if lacks.get(h.name) and h.name not in {x.name for x in via_launch}
            and not (todos and h.name == launch.name)]
    sent = fan(near, lambda h: _send(pool[h], workdir, lacks[h.name], f"{hop}: cannot write"
                                     if via_launch and h.name == launch.name else "cannot write"))
    done.update({n: o for n, o in sent.items() if not o.ok})
    healed: tuple[str, ...] = ()
    if todos and launch.name not in done:
        t = pool[launch]
        try:
            answer = _relay(t, workdir, lacks[launch.name], todos, ssh, hop, share)
        except OrchError as exc:
            done[launch.name] = Outcome(launch, error=exc)
        else:
            try:
                if answer.get("bad"):
                    # the launch host's copy differs from what it listed: send those files again from
                    # here, then pass them on (once)
                    healed = tuple(answer["bad"])
                    _send(t, workdir, [(e, "send") for e in entries if e.rel in answer["bad"]], f"{hop}: cannot write")
                    answer = _relay(t, workdir, [], todos, ssh, hop, share)
                    if answer.get("bad"):
                        rel, why = next(iter(answer["bad"].items()))
                        raise HostError(launch.name, f"sync: {posixpath.join(workdir, rel)} on the launch host, "
                                                     f"which passes the code on: {why}, even after it was sent again",
                                        hint="is the disk failing, or is something rewriting workdir? "
                                             "job.sync_via: controller sends every host its copy from here")
                errors = relay_errors(launch, todos, answer, workdir,
                                      _relay_timeout(ssh.command_timeout, lacks[launch.name], todos))
            except OrchError as exc:
                errors = {n: HostError(n, f"not synced: the launch host {launch.name} passes the code on "
                                          f"(job.sync_via: launch-host), and there: {exc.message}", hint=exc.hint)
                          for n in todos}
            for n, (h, _) in todos.items():
                if n in errors:
                    done[n] = Outcome(h, error=errors[n])
    if todos and launch.name in done:  # nothing was passed on
        for n, (h, _) in todos.items():
            done.setdefault(n, Outcome(h, error=HostError(
                n, f"not synced: the launch host {launch.name}, which passes the code on (job.sync_via: "
                   "launch-host), failed")))
    for h in hosts:
        if h.name not in done:
            done[h.name] = Outcome(h, value=_report(h, entries, lacks[h.name],
                                                    healed if h.name == launch.name else ()))
    return Results((h.name, done[h.name]) for h in hosts)
