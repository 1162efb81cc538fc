"""LocalTransport: `connection: local` hosts run on this machine with sh."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from typing import BinaryIO

from ..errors import RemoteTimeout
from .base import Transport


class LocalTransport(Transport):
    def _exec(self, script, *, stdin, sink, timeout):
        if stdin is not None and not isinstance(stdin, (bytes, bytearray)) and not _has_fileno(stdin):
            spool = tempfile.TemporaryFile()  # a stream produced as it is read: spooled, then fed
            shutil.copyfileobj(stdin, spool, 1 << 20)
            spool.seek(0)
            with spool:
                return self._exec(script, stdin=spool, sink=sink, timeout=timeout)
        feed_bytes = isinstance(stdin, (bytes, bytearray))
        if sink is not None and _has_fileno(sink):
            sink.flush()
        proc = subprocess.Popen(
            ["sh", "-c", script],
            stdin=subprocess.PIPE if feed_bytes else (stdin if stdin is not None else subprocess.DEVNULL),
            stdout=subprocess.PIPE if sink is None or not _has_fileno(sink) else sink,
            stderr=subprocess.PIPE, start_new_session=True)
        try:
            if sink is not None and not _has_fileno(sink):
                return self._stream(proc, bytes(stdin) if feed_bytes else None, sink, timeout)
            out, err = proc.communicate(input=bytes(stdin) if feed_bytes else None, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc)
            proc.communicate()
            raise RemoteTimeout(self.host.name, f"command timed out after {timeout:g}s",
                                hint="raise ssh.command_timeout if the host is just slow") from None
        except BaseException:
            _killpg(proc)
            raise
        if sink is not None and out:
            sink.write(out)
            out = b""
        if sink is not None and _has_fileno(sink):
            sink.seek(0, os.SEEK_END)
        return proc.returncode, out or b"", err or b""


    def _stream(self, proc: subprocess.Popen, data: bytes | None, sink, timeout: float):
        """Pass stdout on to `sink` as it comes; `timeout` bounds a silence, not the whole run
        (as for SSH: a stream may be long)."""
        import select
        import threading
        import time

        def feed() -> None:
            assert proc.stdin is not None  # started only when there is one
            try:
                if data:
                    proc.stdin.write(data)
                proc.stdin.close()
            except OSError:
                pass

        errs: list[bytes] = []
        stderr = proc.stderr
        assert proc.stdout is not None and stderr is not None  # both are pipes here
        if proc.stdin is not None:
            threading.Thread(target=feed, daemon=True).start()
        t = threading.Thread(target=lambda: errs.append(stderr.read()), daemon=True)
        t.start()
        fd = proc.stdout.fileno()
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                sink.write(chunk)
                last = time.monotonic()
            elif time.monotonic() - last > timeout:
                _killpg(proc)
                proc.wait()
                raise RemoteTimeout(self.host.name, f"no output for {timeout:g}s",
                                    hint="raise ssh.command_timeout if the host is just slow")
        proc.wait()
        t.join(5)
        return proc.returncode, b"", b"".join(errs)


def _has_fileno(fh: BinaryIO) -> bool:
    try:
        fh.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
