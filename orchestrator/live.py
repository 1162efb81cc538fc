"""`orch up`'s live view on a terminal: a few lines (top.panel) kept under the followed rank's
output, which streams above them untouched.

The panel is drawn on stderr and erased before anything else reaches the terminal (the rank's
bytes on stdout, orch's own messages), then drawn again under it. It may be drawn while the
rank's last line is unfinished (no newline yet): the rows it needs are made first (IND, which
scrolls the screen like a newline but keeps the column), the cursor is saved at the end of the
rank's text (DECSC) and the panel starts on the next row; erasing restores the cursor there
(DECRC) and clears to the end of the screen, so the rank's line goes on where it stopped. Both
are plain VT100 (xterm, VTE, tmux, screen, Windows Terminal). Only the CLI uses this, and only
when stderr is a terminal: in a pipe nothing here runs.
"""

from __future__ import annotations

import contextlib
from typing import IO, Iterator

IND, SAVE, RESTORE, CLEAR_BELOW = "\x1bD", "\x1b7", "\x1b8", "\x1b[J"


def draw(lines: list[str]) -> str:
    """The control string that shows `lines` under the cursor's row (the cursor is saved first)."""
    n = len(lines)
    return IND * n + f"\x1b[{n}A" + SAVE + "".join("\r\n" + ln for ln in lines)


ERASE = RESTORE + CLEAR_BELOW


class Panel:
    """The lines on screen under the rank's output. `show` replaces them; `above()` is where
    anything else is written (erased before, drawn again after); `close` leaves them where they
    are, as the last word, and moves on below."""

    def __init__(self, err: IO[str], out: IO[bytes] | None = None):
        self.err, self.out = err, out
        self.lines: list[str] = []
        self.shown = False

    def show(self, lines: list[str]) -> None:
        if lines == self.lines and self.shown:
            return
        self.lines = list(lines)
        self.err.write((ERASE if self.shown else "") + (draw(self.lines) if self.lines else ""))
        self.err.flush()
        self.shown = bool(self.lines)

    @contextlib.contextmanager
    def above(self) -> Iterator[None]:
        """Write to the terminal inside this: the panel is gone meanwhile, and back after."""
        if self.shown:
            self.err.write(ERASE)
            self.err.flush()
            self.shown = False
        try:
            yield
        finally:
            if self.out is not None:
                self.out.flush()
            if self.lines:
                self.err.write(draw(self.lines))
                self.err.flush()
                self.shown = True

    def write(self, data: bytes) -> None:
        """The followed rank's bytes, as they came, above the panel."""
        assert self.out is not None
        with self.above():
            self.out.write(data)

    def close(self) -> None:
        """The last lines shown stay on screen; what follows is printed under them."""
        if self.shown:
            self.err.write("\r\n")
            self.err.flush()
        self.shown = False
        self.lines = []
