"""Distribute code and rendered files to every host before launch.

`manifest()` (local I/O only) lists what `job.sync` names: files and directory
trees, with mode, size and sha256. On each host, over its one connection:
one round trip creates workdir and hashes what is already there, only files
whose checksum differs are written (atomically, modes kept), and one last
round trip verifies every checksum. A host that cannot take the files fails
the launch before anything runs, naming host and path.
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from dataclasses import dataclass
from pathlib import Path

from .errors import HostError, Location, SpecError
from .transport import Transport


@dataclass(frozen=True)
class Entry:
    local: Path
    rel: str       # posix path relative to workdir
    mode: int
    size: int
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(base: Path, sync: tuple[str, ...], cluster_file: str) -> list[Entry]:
    """Every file under the `sync` paths (relative to `base`), in a stable order."""
    entries: dict[str, Entry] = {}
    problems = []
    for i, item in enumerate(sync):
        src = (base / item).resolve()
        if not src.exists():
            problems.append((Location(cluster_file, None, f"job.sync[{i}]"),
                             f"{item!r} does not exist (looked for {src})"))
            continue
        top = Path(item.rstrip("/")).name if src.is_dir() else Path(item).name
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for f in files:
            rel = top if f == src else posixpath.join(top, f.relative_to(src).as_posix())
            st = f.stat()
            entries[rel] = Entry(f, rel, st.st_mode & 0o7777, st.st_size, _sha256(f))
    if problems:
        raise SpecError(problems, hint="fix job.sync, or create the files")
    return [entries[k] for k in sorted(entries)]


def _hash_script(workdir: str, rels: list[str]) -> str:
    """Create workdir; print `INDEX SHA256` for each of `rels` that exists there. By index, not
    name: sha256sum escapes names holding a backslash or a newline, and any name is allowed."""
    q = shlex.quote(workdir)
    files = " ".join(shlex.quote(r) for r in rels)
    body = f"mkdir -p {q} || exit 41\ncd {q} || exit 41\ntest -w . || exit 42\n"
    if rels:
        body += (f"i=0\nfor f in {files}; do\n"
                 "  [ -f \"$f\" ] && printf '%s %s\\n' \"$i\" \"$(sha256sum < \"$f\" | cut -c1-64)\"\n"
                 "  i=$((i+1))\ndone\n")
    return body + "exit 0"


def _parse_hashes(text: str, rels: list[str]) -> dict[str, str]:
    """_hash_script's output -> {relative path: sha256}."""
    out = {}
    for line in text.splitlines():
        index, _, digest = line.partition(" ")
        if index.isascii() and index.isdigit() and int(index) < len(rels) and len(digest) == 64:
            out[rels[int(index)]] = digest
    return out


@dataclass(frozen=True)
class SyncReport:
    host: str
    copied: tuple[str, ...]
    unchanged: tuple[str, ...]


def sync_host(t: Transport, workdir: str, entries: list[Entry], extra: dict[str, bytes] | None = None) -> SyncReport:
    """Bring `workdir` on one host up to date with `entries`; write `extra` files
    ({relative path: bytes}) too. Verifies checksums afterwards."""
    host = t.host.name
    rels = [e.rel for e in entries]
    res = t.run(_hash_script(workdir, rels))
    if res.exit_code == 41:
        raise HostError(host, f"cannot create workdir {workdir}: {res.err.strip()}",
                        hint="check job.workdir and the user's permissions on the host")
    if res.exit_code == 42:
        raise HostError(host, f"workdir {workdir} is not writable by {t.host.user}")
    res.check(f"hashing files in {workdir}")
    have = _parse_hashes(res.out, rels)
    copied, unchanged = [], []
    for e in entries:
        if have.get(e.rel) == e.sha256:
            unchanged.append(e.rel)
            continue
        _put(t, e.local, posixpath.join(workdir, e.rel), e.mode)
        copied.append(e.rel)
    for rel, data in (extra or {}).items():
        _put(t, data, posixpath.join(workdir, rel), 0o644)
    if copied:
        after = _parse_hashes(t.run(_hash_script(workdir, copied)).check("verifying copied files").out, copied)
        bad = [e.rel for e in entries if e.rel in copied and after.get(e.rel) != e.sha256]
        if bad:
            raise HostError(host, f"checksum mismatch after copying {', '.join(bad)} to {workdir}",
                            hint="the disk may be full or the files changed while copying; run again")
    return SyncReport(host, tuple(copied), tuple(unchanged))


def _put(t: Transport, src, remote: str, mode: int) -> None:
    try:
        t.put(src, remote, mode=mode)
    except HostError as exc:
        detail = exc.result.err.strip() if getattr(exc, "result", None) is not None else str(exc)
        raise HostError(t.host.name, f"cannot write {remote}: {detail}",
                        hint="is the disk full, or the directory not writable?") from None
