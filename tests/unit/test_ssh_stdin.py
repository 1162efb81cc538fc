"""A command's stdin made as it is read (transport Reader): the time this side takes to have its
bytes is not the host's, and the command's timeout does not count it."""

from __future__ import annotations

import os
import time

import pytest

from orchestrator.errors import RemoteTimeout
from orchestrator.transport.ssh import _feed_and_read


class Chan:
    """A channel whose command answers `answer_after` seconds after its stdin ends (its fd never
    readable: select waits its whole timeout, as on a quiet channel)."""

    def __init__(self, answer_after: float):
        self.r, self.w = os.pipe()
        self.answer_after, self.ended, self.taken, self.sent, self.closed = answer_after, None, False, b"", False

    def close_fds(self) -> None:
        os.close(self.r)
        os.close(self.w)

    def fileno(self) -> int:
        return self.r

    def settimeout(self, t) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.sent += data

    def shutdown_write(self) -> None:
        self.ended = time.monotonic()

    def _answered(self) -> bool:
        return self.ended is not None and time.monotonic() - self.ended >= self.answer_after

    def recv_ready(self) -> bool:
        return self._answered() and not self.taken

    def recv(self, n: int) -> bytes:
        self.taken = True
        return b"ok\n"

    def recv_stderr_ready(self) -> bool:
        return False

    @property
    def eof_received(self) -> bool:
        return self._answered()

    def exit_status_ready(self) -> bool:
        return self._answered()

    def recv_exit_status(self) -> int:
        return 0


class Later:
    """stdin: `first`, then `rest` after `wait` seconds (a supervisor's start waiting for the sync)."""

    def __init__(self, first: bytes, rest: bytes, wait: float):
        self.parts, self.wait = [first, rest], wait

    def read(self, n: int = -1, /) -> bytes:
        if not self.parts:
            return b""
        if len(self.parts) == 1:
            time.sleep(self.wait)
        return self.parts.pop(0)


def test_the_time_stdin_takes_here_is_not_the_commands():
    chan = Chan(answer_after=0.1)
    try:
        timeout = 0.3
        rc, out, _, _ = _feed_and_read(chan, Later(b"pkg\n", b"conf\n", wait=0.5), None,  # type: ignore[arg-type]  # a stand-in channel
                                       time.monotonic() + timeout, "h1", timeout)
        assert (rc, out, chan.sent) == (0, b"ok\n", b"pkg\nconf\n")
    finally:
        chan.close_fds()


def test_a_command_that_does_not_answer_in_time_still_times_out():
    chan = Chan(answer_after=5)
    try:
        with pytest.raises(RemoteTimeout, match="timed out after 0.3s"):
            _feed_and_read(chan, Later(b"pkg\n", b"conf\n", wait=0.2), None, time.monotonic() + 0.3, "h1", 0.3)  # type: ignore[arg-type]  # a stand-in channel
    finally:
        chan.close_fds()
