"""The run's figures over time, kept by the head in `<run dir>/history.jsonl` for `orch report`:
one line every `every` seconds (10 s, more for large runs: ranks / 100 s), each rank's steps,
loss and steps/s and each host's load at that moment. Bounded: past LIMIT bytes the interval
doubles, so a long run thins its history instead of filling the disk.

    {"t": 1700000000.0, "attempt": 1,
     "p": {"<rank>": [steps, loss, steps/s]}, "l": {"<host>": [cpu %, memory MiB, accelerator %]}}
"""

import os

from . import jsonc

HISTORY = "history.jsonl"
LIMIT = 64 << 20


class History:
    def __init__(self, rundir, n_ranks, note=None):
        self.path = os.path.join(rundir, HISTORY)
        self.every = max(10.0, n_ranks / 100.0)
        self.last = 0.0
        self.limit = LIMIT
        self.note = note

    def maybe(self, doc, now, final=False):
        """Append a line when one is due (from the head's publish), and a last one when the run
        has ended (`final`, once). Never raises."""
        if final and self.last >= 0:
            self.last = -1.0    # the last line: none after it
        elif now - self.last < self.every or self.last < 0:
            return False
        else:
            self.last = now
        prog = doc.get("progress") or {}
        load = doc.get("load") or {}
        line = {"t": round(now, 2), "attempt": doc.get("attempt"),
                "p": {k: [v.get("total"), v.get("loss"), v.get("rate")] for k, v in prog.items()},
                "l": {h: [v.get("cpu"), v.get("mem_mib"), v.get("acc_util")] for h, v in load.items()}}
        if not line["p"] and not line["l"]:
            return False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, (jsonc.dumps(line, separators=(",", ":")) + "\n").encode())
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            if self.note:
                self.note("cannot keep the run's history: %s" % exc)
            return False
        if size > self.limit:
            self.every *= 2
            self.limit += LIMIT // 2
            if self.note:
                self.note("history.jsonl is past %d MiB: one line every %gs from now on" % (size >> 20, self.every))
        return True
