"""`orch up`'s live view on a terminal: a few lines (top.panel) kept under the followed rank's
output, which streams above them untouched.

The panel is drawn on stderr and erased before anything else reaches the terminal (the rank's
bytes on stdout, orch's own messages), then drawn again under it. It may be drawn while the
rank's last line is unfinished (no newline yet): the rows it needs are made first (IND, which
scrolls the screen like a newline but keeps the column), the cursor is saved at the end of the
rank's text (DECSC) and the panel starts on the next row (on the cursor's own row when that is
empty); erasing restores the cursor there (DECRC) and clears to the end of the screen, so the
rank's line goes on where it stopped. All plain VT100 (xterm, VTE, tmux, screen, Windows
Terminal). Only the CLI uses this, and only when stderr is a terminal: in a pipe nothing here runs.
"""

from __future__ import annotations

import contextlib
from typing import IO, Iterator

IND, SAVE, RESTORE, CLEAR_BELOW = "\x1bD", "\x1b7", "\x1b8", "\x1b[J"


def draw(lines: list[str], at_line_start: bool = True) -> str:
    """The control string that shows `lines` from the cursor's row (`at_line_start`: the cursor is
    at the start of an empty row) or else from the next row, the cursor saved where it was."""
    below = len(lines) - 1 if at_line_start else len(lines)
    make_room = IND * below + (f"\x1b[{below}A" if below else "")
    return make_room + SAVE + ("" if at_line_start else "\r\n") + "\r\n".join(lines)


ERASE = RESTORE + CLEAR_BELOW


class Panel:
    """The lines on screen under the rank's output. `show` replaces them; `above()` is where
    anything else is written (erased before, drawn again after); `close` leaves them where they
    are, as the last word, and moves on below."""

    def __init__(self, err: IO[str], out: IO[bytes], out_on_terminal: bool = True):
        self.err, self.out = err, out
        self.out_on_terminal = out_on_terminal   # else the rank's bytes go elsewhere (a file)
        self.lines: list[str] = []
        self.shown = False
        self.at_line_start = True   # the cursor: after a newline (orch's messages end with one)

    def show(self, lines: list[str]) -> None:
        if lines == self.lines and self.shown:
            return
        self._erase()
        self.lines = list(lines)
        self._draw()

    def _erase(self) -> None:
        if self.shown:
            self.err.write(ERASE)
            self.err.flush()
            self.shown = False

    def _draw(self) -> None:
        if self.lines:
            self.err.write(draw(self.lines, self.at_line_start))
            self.err.flush()
            self.shown = True

    @contextlib.contextmanager
    def above(self) -> Iterator[None]:
        """Write whole lines to the terminal inside this: the panel is gone meanwhile, and back after."""
        self._erase()
        try:
            yield
        finally:
            self.at_line_start = True
            self._draw()

    def write(self, data: bytes) -> None:
        """The followed rank's bytes, as they came (a line may be unfinished), above the panel."""
        self._erase()
        try:
            self.out.write(data)
            self.out.flush()
        finally:
            if data and self.out_on_terminal:
                self.at_line_start = data.endswith(b"\n")
            self._draw()

    def close(self) -> None:
        """The last lines shown stay on screen; what follows is printed under them."""
        if self.shown:
            self.err.write("\r\n")
            self.err.flush()
        self.shown = False
        self.lines = []
