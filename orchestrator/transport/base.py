"""The Transport protocol and everything local and SSH transports share.

A transport knows ONE primitive, `_exec(script, stdin, sink, timeout)`: run a
POSIX sh script on the host, feeding it stdin and collecting its output.
run/put/get/spawn/kill are built on that primitive here, once, so both
transports behave identically (quoting, atomic writes, detached processes).
Scripts are data: built by the pure functions at the bottom of this module.

Scripts carry environment values, secrets included, and any user of a host can
read every process's command line (`ps`). So a script never travels on a command
line when it can help it: `run` sends it on stdin to a constant bootstrap
(BOOTSTRAP) unless stdin carries data (`put`, whose scripts hold no values), and
a detached process's long-lived `sh -c` holds its command and log paths but not
its environment, which it inherits instead.
"""

from __future__ import annotations

import os
import shlex
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Mapping, Protocol, Sequence

from .. import sh
from ..errors import LocalWriteError, RemoteCommandError
from ..model import Host

CHUNK = 1 << 16
# What runs on the remote command line when the script comes on stdin: read it all (stdin is
# then at EOF for the script's commands, as it would be without a script on it), then run it.
BOOTSTRAP = 'eval "$(cat)"'
# A session held for a later command (Transport.probe(hold=True), then start_held): the script
# comes on stdin, but stdin stays open after it, so it reads exactly its bytes; once the script's
# shell ends (its last line PROBE_END), a process the script left holding the channel's stdin
# and stdout (checks/reach.py: HOLD_PY) takes `go N` and N bytes (held_go), answers HELD_GO,
# runs them and ends with `HELD_EXIT <status>`.
HELD_BOOTSTRAP = 'eval "$(head -c {n})"'
PROBE_END = b"@@orch:probe-end\n"
HELD_GO = b"@@orch:go\n"
HELD_EXIT = b"@@orch:exit"
HELD_MAX = 1 << 20  # bytes of a go at most


class Reader(Protocol):
    """What `run` reads stdin from, when it is not bytes: an open file, or a stream made as it is read."""

    def read(self, n: int = -1, /) -> bytes: ...


class Writer(Protocol):
    """Where `run` passes stdout on to (`sink`): an open file, or an object that consumes it."""

    def write(self, data: bytes, /) -> int: ...


@dataclass(frozen=True)
class Result:
    """What one remote command did. Bytes, not text: logs must stay byte-exact."""

    host: str
    command: str
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self, what: str | None = None) -> Result:
        if self.exit_code != 0:
            tail = (self.err.strip() or self.out.strip())[-500:]
            raise RemoteCommandError(
                self.host, f"{what or 'command'} failed with exit code {self.exit_code}"
                + (f": {tail}" if tail else ""), result=self)
        return self


class Transport(ABC):
    """One host. `run` (and what is built on it) may be called from several threads at once: each
    call is a session of its own on the host's one connection (SSH), or a process of its own
    (local); probe(hold=True) keeps one session, which start_held or release_held takes."""

    def __init__(self, host: Host, command_timeout: float = 120):
        self.host = host
        self.command_timeout = command_timeout

    # ---- the one primitive a transport implements
    @abstractmethod
    def _exec(self, script: str, *, stdin: bytes | Reader | None, sink: Writer | None,
              timeout: float) -> tuple[int, bytes, bytes]:
        """Run `script` with sh; return (exit code, stdout, stderr). If `sink` is given,
        stdout is streamed into it (and the returned stdout is b"")."""

    def connect(self, attempts: int | None = None) -> None:  # noqa: B027 - a no-op unless the transport has a connection
        """Open the connection now (SSH: up to `attempts` tries, default ssh.retries); a no-op locally."""

    def close(self) -> None:  # noqa: B027 - a no-op unless the transport has a connection
        """Release the connection."""

    # ---- shared operations
    def run(self, command: str | Sequence[str], *, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float | None = None, stdin: bytes | Reader | None = None,
            sink: Writer | None = None, connect_attempts: int | None = None) -> Result:
        """Run a command. A sequence is an argv (every item quoted); a string is a sh snippet.
        Without `stdin`, the script itself goes on stdin (see BOOTSTRAP): never on a command line.
        `connect_attempts`: if a connection must be opened first, at most this many tries (a
        caller with its own loop, e.g. following a run, wants one bounded try, not ssh.retries)."""
        script = build_script(command, env=env, cwd=cwd)
        start = time.monotonic()
        if connect_attempts is not None:
            self.connect(connect_attempts)
        timeout = timeout if timeout is not None else self.command_timeout
        if stdin is None:
            rc, out, err = self._exec(BOOTSTRAP, stdin=script.encode(), sink=sink, timeout=timeout)
        else:
            rc, out, err = self._exec(script, stdin=stdin, sink=sink, timeout=timeout)
        return Result(self.host.name, script, rc, out, err, time.monotonic() - start)

    def probe(self, script: str, *, sink: Writer | None = None, hold: bool = False) -> Result:
        """run(script, sink=sink); `hold` (SSH): the session stays open past the script's end for
        start_held, if the script left a process holding it (else release_held drops it)."""
        return self.run(script, sink=sink)

    def start_held(self, env: Mapping[str, str], argv: Sequence[str], stdin: Reader) -> Result | None:
        """In the session probe(hold=True) kept: `python3 -S -c argv...` with `env`, its stdin
        from `stdin`, as the process that holds it runs it. None: no session held, or its
        process was gone before it took the command (nothing ran: run it another way)."""
        return None

    def release_held(self) -> None:  # noqa: B027 - a no-op unless a session is held
        """Close the session probe(hold=True) kept, if any (its process then exits)."""

    def put(self, data: bytes | str | os.PathLike, remote: str, *, mode: int | None = None,
            timeout: float | None = None) -> None:
        """Write bytes or a local file to `remote` atomically (temp file + rename).
        A local file's permission bits are kept unless `mode` is given."""
        if isinstance(data, (bytes, bytearray)):
            self.run(put_script(remote, mode if mode is not None else 0o644), stdin=bytes(data),
                     timeout=timeout).check(f"writing {remote}")
            return
        path = Path(data)
        if mode is None:
            mode = path.stat().st_mode & 0o7777
        with open(path, "rb") as fh:
            self.run(put_script(remote, mode), stdin=fh, timeout=timeout).check(f"writing {remote}")

    def get(self, remote: str, local: str | os.PathLike, *, offset: int = 0,
            timeout: float | None = None) -> int:
        """Copy `remote` to `local`, streaming. With offset > 0, append only the bytes from
        `offset` on (incremental log gathering). Returns the number of bytes copied."""
        local = Path(local)
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            if offset:
                if not local.exists() or local.stat().st_size < offset:
                    raise ValueError(f"{local} holds fewer than {offset} bytes: cannot resume there")
                with open(local, "ab") as fh:
                    fh.truncate(offset)
                    res = self.run(get_script(remote, offset), sink=_LocalSink(fh, local), timeout=timeout)
                    n = fh.tell() - offset
            else:
                fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.")
                try:
                    with os.fdopen(fd, "wb") as fh:
                        res = self.run(get_script(remote, 0), sink=_LocalSink(fh, local), timeout=timeout)
                        n = fh.tell()
                    if res.ok:
                        os.replace(tmp, local)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        except OSError as exc:  # this machine's side (a full disk): never mistaken for the network
            raise LocalWriteError.of_log(local, exc) from None
        res.check(f"reading {remote}")
        return n


# --------------------------------------------------------------------------- pure script builders


class _LocalSink:
    """A local file a transport streams into. Its write errors (ENOSPC) are this machine's, and
    leave as LocalWriteError, which no transport takes for a broken connection (an OSError would)."""

    def __init__(self, fh: BinaryIO, path: Path):
        self._fh, self._path = fh, path

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            raise LocalWriteError.of_log(self._path, exc) from None

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as exc:
            raise LocalWriteError(f"cannot write {self._path}: {exc.strerror or exc}") from None

    def fileno(self) -> int:
        return self._fh.fileno()

    def seek(self, *a):
        return self._fh.seek(*a)

    def tell(self) -> int:
        return self._fh.tell()


def held_go(env: Mapping[str, str], argv: Sequence[str]) -> bytes:
    """What a held session's process takes (HOLD_PY): `go N`, then N bytes: the number of
    variables, each name and value, then the arguments, NUL-separated (none of them can hold one)."""
    fields = [str(len(env)), *(x for kv in env.items() for x in kv), *argv]
    payload = b"\0".join(os.fsencode(f) for f in fields)
    if len(payload) > HELD_MAX or any("\0" in f for f in fields):
        raise ValueError("a held session's command is too long or holds a NUL byte")
    return b"go %d\n" % len(payload) + payload


def quote_argv(argv: Iterable[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def build_script(command: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, exec_argv: bool = False) -> str:
    """env exports, cd, then the command: a sh snippet as is, an argv quoted (and with
    `exec_argv`, exec'd: the shell becomes the command instead of waiting for it)."""
    parts = sh.exports(env)
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} || exit 125")
    if isinstance(command, str):
        parts.append(command)
    else:
        parts.append(("exec " if exec_argv else "") + quote_argv(command))
    return "\n".join(parts)


def put_script(remote: str, mode: int) -> str:
    q = shlex.quote(remote)
    d = shlex.quote(os.path.dirname(remote) or ".")
    return (f"set -e\nmkdir -p {d}\ntmp=$(mktemp {d}/.orch-put.XXXXXX)\n"
            f"trap 'rm -f \"$tmp\"' EXIT\ncat > \"$tmp\"\nchmod {mode & 0o7777:o} \"$tmp\"\n"
            f"mv -f \"$tmp\" {q}\ntrap - EXIT")


def get_script(remote: str, offset: int) -> str:
    return f"exec tail -c +{int(offset) + 1} {shlex.quote(remote)}"
