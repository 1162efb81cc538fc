"""Progress read from the ranks' output, on each host, by the host's supervisor.

A rank writes its output to its log file itself (procs.spawn, `agent.py rank`, mpirun's
--output-filename); the supervisor already stats each log every tick to see it grow. When it
grew, `Progress.read` reads the new bytes (at most READ_BUDGET per rank and tick: a rank that
writes faster has its oldest unread bytes skipped, counted in `skipped`) and runs the patterns
over the complete lines: the built-in ones (BUILTIN) and `job.metrics` (name -> a regular
expression with one group). The rank pays nothing: it never waits for the parser, which reads
the file behind it.

What is kept per rank is a few numbers (RankProgress); an unfinished line is kept only up to
MAX_LINE bytes (the rest of a longer line is skipped), so no output, whatever its bytes, makes
the supervisor hold more than READ_BUDGET + MAX_LINE bytes per rank at a time. Bytes that are not
UTF-8, NULs, escape sequences: the patterns run over bytes and simply do not match them.

`report()` is what a member sends the head (in its report, `progress`); `parse_progress`
checks what a member sent (protocol.parse_report calls it); `merge` puts a host's ranks'
progress into the run's document (`doc["progress"]`, keyed by rank).
"""

from __future__ import annotations

import math
import os

from .layout import TYPE_CHECKING, compiled

if TYPE_CHECKING:
    from typing import Any, Callable

READ_BUDGET = 1 << 20     # bytes read per rank and tick
MAX_LINE = 4096           # an unfinished line kept at most this long
MAX_NAMES = 32            # job.metrics entries
MAX_VALUES = 48           # values kept per rank (built-in + job.metrics + HF dict keys)
_NAME_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_REST = _NAME_FIRST | frozenset("0123456789.-")
RATE_WINDOW = 10.0        # seconds over which steps/s is measured
REPORT_VALUES = 256 << 10  # the values of a host's ranks in one report, at most (a frame is 1 MiB)

_NUM = rb"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|NaN|inf|Inf|Infinity)"
# name, what a match must contain (a chunk without it is not searched), pattern: named groups
# `epoch`, `step`, `loss` feed the core fields, others become values
BUILTIN = (
    # MindSpore's LossMonitor and the playbooks: "epoch: 1, step: 20, loss is 2.30" (also without
    # the commas, and MindSpore's "loss is Tensor(shape=[], dtype=Float32, value= 2.30)")
    ("mindspore", b"epoch:", rb"epoch:\s*(?P<epoch>\d+)\s*,?\s*step:\s*(?P<step>\d+)\s*,?\s*loss is\s*"
                  rb"(?:Tensor\([^)\n]{0,80}?value=\s*)?\[?\s*(?P<loss>" + _NUM + rb")"),
    # MindSpore's TimeMonitor: "epoch time: 1234.5 ms, per step time: 12.3 ms" ("Train epoch time" in 2.x)
    ("mindspore_time", b"epoch time:", rb"epoch time:\s*(?P<epoch_time_ms>" + _NUM + rb")\s*ms,\s*per step time:\s*"
                       rb"(?P<step_time_ms>" + _NUM + rb")\s*ms"),
    # Hugging Face Trainer's logged dicts: {'loss': 0.69, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.5}
    ("hf", b"{'", rb"\{'(?:loss|eval_loss|train_loss|train_runtime)': [^{}\n]{0,2000}\}"),
)
_HF_PAIR = rb"'([A-Za-z_][A-Za-z0-9_]{0,63})': (" + _NUM + rb")(?=[,}])"
_HF_STEP = ("global_step", "step")


def name_ok(name):
    """A metric's name: a letter or _, then up to 63 letters (ASCII), digits, _ . or -
    (the regular expression [A-Za-z_][A-Za-z0-9_.-]{0,63}\\Z, without re)."""
    return (isinstance(name, str) and 0 < len(name) <= 64 and name[0] in _NAME_FIRST
            and all(c in _NAME_REST for c in name[1:]))


class MetricsError(ValueError):
    """A job.metrics entry that cannot be used: (name, what is wrong)."""

    def __init__(self, name, why):
        ValueError.__init__(self, "%s: %s" % (name, why))
        self.name, self.why = name, why


def check_pattern(name, pattern):
    """One job.metrics entry -> its compiled pattern (bytes, MULTILINE). MetricsError names what
    is wrong: the name, a pattern that does not compile, not exactly one group."""
    if not name_ok(name):
        raise MetricsError(str(name)[:64], "a metric's name is a letter or _ followed by up to 63 letters, "
                                           "digits, _ . or - (e.g. loss, top1_acc)")
    if not isinstance(pattern, str) or not pattern:
        raise MetricsError(name, "the pattern must be a non-empty string (a regular expression with one group)")
    import re   # here: job.metrics alone needs it (layout.compiled says why)
    try:
        rx = re.compile(pattern.encode("utf-8"), re.MULTILINE)
    except (re.error, OverflowError, RecursionError) as exc:
        raise MetricsError(name, "%r is not a regular expression: %s" % (pattern, exc)) from None
    if rx.groups != 1:
        raise MetricsError(name, "%r has %d groups; it needs exactly one, around the number (e.g. 'acc=([0-9.]+)'; "
                                 "write other parentheses as (?:...))" % (pattern, rx.groups))
    return rx


def check_patterns(metrics):
    """job.metrics -> {name: compiled}; MetricsError for the first bad entry."""
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise MetricsError("metrics", "a mapping of name -> regular expression expected")
    if len(metrics) > MAX_NAMES:
        raise MetricsError("metrics", "at most %d entries (%d given)" % (MAX_NAMES, len(metrics)))
    return {name: check_pattern(name, pattern) for name, pattern in metrics.items()}


def number(text):
    """bytes or str of a number -> a float, or "nan"/"inf"/"-inf" (JSON has no such numbers); None if not one."""
    try:
        v = float(text)
    except (ValueError, TypeError, OverflowError):
        return None
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


class RankProgress:
    """What one rank's output says so far (this attempt)."""

    __slots__ = ("rank", "step", "epoch", "loss", "values", "total", "records", "out", "seen", "skipped",
                 "partial", "drop", "offset", "samples", "t_step")

    def __init__(self, rank):
        self.rank = rank
        self.step = self.epoch = self.loss = None
        self.values = {}
        self.total = 0          # steps done, summed over epochs (a step counter that restarts each epoch)
        self.records = 0        # progress lines seen
        self.out = None         # when the output last grew
        self.seen = 0           # bytes read
        self.skipped = 0        # bytes skipped (a rank writing faster than READ_BUDGET a tick)
        self.partial = b""      # an unfinished last line (at most MAX_LINE bytes)
        self.drop = False       # inside an over-long line: skip to its end
        self.offset = 0
        self.samples = []       # (time, total) over the last RATE_WINDOW seconds
        self.t_step = None      # when a step was last seen

    def rate(self, now):
        """Steps per second over the last RATE_WINDOW seconds (None before two samples)."""
        s = [x for x in self.samples if now - x[0] <= RATE_WINDOW]
        if len(s) < 2 or s[-1][0] <= s[0][0]:
            return 0.0 if self.t_step is not None and now - self.t_step > RATE_WINDOW else None
        return round((s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]), 3)

    def record(self, now):
        out = {"rank": self.rank, "step": self.step, "epoch": self.epoch, "loss": self.loss, "total": self.total,
               "records": self.records, "rate": self.rate(now), "out": self.out, "t_step": self.t_step}
        if self.values:
            out["values"] = dict(self.values)
        return out


class Progress:
    """Every rank's progress on this host, for one attempt."""

    def __init__(self, metrics=None, note=None, enabled=True):
        self.enabled = enabled
        self.user = {}
        try:
            self.user = check_patterns(metrics)
        except MetricsError as exc:   # the controller checked it already; an old one did not
            if note:
                note("job.metrics ignored: %s" % exc)
        self.ranks = {}

    def reset(self, ranks):
        self.ranks = {r: RankProgress(r) for r in ranks}

    def read(self, rank, path, size, now):
        """The log of `rank` at `path` is now `size` bytes long: parse what is new."""
        p = self.ranks.get(rank)
        if p is None:
            p = self.ranks[rank] = RankProgress(rank)
        p.out = now
        if not self.enabled:
            return
        if size < p.offset:   # truncated, or another file: from its start
            p.offset, p.partial, p.drop = 0, b"", False
        if size == p.offset:
            return
        start = p.offset
        if size - start > READ_BUDGET:   # too much at once: the newest READ_BUDGET bytes
            p.skipped += size - READ_BUDGET - start
            start = size - READ_BUDGET
            p.partial, p.drop = b"", True
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return
        try:
            os.lseek(fd, start, 0)
            data = os.read(fd, size - start)
        except OSError:
            return
        finally:
            os.close(fd)
        p.offset = start + len(data)
        p.seen += len(data)
        self.feed(p, data, now)

    def feed(self, p, data, now):
        """New bytes of one rank's output: parse the complete lines, keep the unfinished one."""
        cut = data.rfind(b"\n")
        if cut < 0:
            if not p.drop:
                p.partial += data
                if len(p.partial) > MAX_LINE:
                    p.skipped += len(p.partial)
                    p.partial, p.drop = b"", True
            return
        head, tail = data[:cut + 1], data[cut + 1:]
        if p.drop:   # the rest of an over-long (or cut) line: skip to its end
            nl = head.find(b"\n")
            p.skipped += nl + 1
            head = head[nl + 1:]
            p.drop = False
        elif p.partial:
            head = p.partial + head
        p.partial = b""
        if len(tail) > MAX_LINE:
            p.skipped += len(tail)
            p.drop = True
        else:
            p.partial = tail
        if head:
            self.parse(p, head, now)

    def parse(self, p, text, now):
        """Complete lines -> p's fields. Each pattern scans the whole text (in C); only the lines
        that match cost python time, and of a chunk only the last value of each counts."""
        steps = 0
        for name, needle, pattern in BUILTIN:
            if needle not in text:
                continue
            rx = compiled(pattern)
            last = None
            for m in rx.finditer(text):
                if name == "mindspore":
                    steps += _step(p, int(m.group("step")), int(m.group("epoch")))
                last = m
            if last is None:
                continue
            if name == "mindspore":
                p.loss = number(last.group("loss"))
            elif name == "mindspore_time":
                self.put(p, "epoch_time_ms", number(last.group("epoch_time_ms")))
                self.put(p, "step_time_ms", number(last.group("step_time_ms")))
            elif name == "hf":
                steps += self.hf(p, rx, text)
        for name, rx in self.user.items():
            last = None
            for last in rx.finditer(text):
                if name == "step":
                    v = number(last.group(1))
                    if isinstance(v, float):
                        steps += _step(p, int(v), p.epoch)
            if last is None or name == "step":
                continue
            v = number(last.group(1))
            if name == "loss":
                p.loss = v
            elif name == "epoch":
                p.epoch = v if isinstance(v, float) else p.epoch
            else:
                self.put(p, name, v)
        if steps:
            p.total += steps
            p.t_step = now
            if p.samples and p.samples[-1][0] == now:
                p.samples[-1] = (now, p.total)
            else:
                p.samples.append((now, p.total))
            while p.samples and now - p.samples[0][0] > RATE_WINDOW:
                p.samples.pop(0)

    def hf(self, p, rx, text):
        """Hugging Face Trainer's dicts: loss, epoch and every other number (learning_rate, grad_norm...)."""
        steps = 0
        for m in rx.finditer(text):
            pairs = dict(compiled(_HF_PAIR).findall(m.group(0)))
            if b"loss" in pairs:
                p.loss = number(pairs[b"loss"])
                p.records += 1
                steps += 1
            for k, v in pairs.items():
                key = k.decode("ascii")
                if key == "epoch":
                    p.epoch = number(v)
                elif key in _HF_STEP and number(v) is not None:
                    p.step = number(v)
                elif key != "loss":
                    self.put(p, key, number(v))
        return steps

    @staticmethod
    def put(p, name, v):
        if v is not None and (name in p.values or len(p.values) < MAX_VALUES):
            p.values[name] = v

    def report(self, now):
        """What a member sends the head: each rank's figures (only ranks whose output grew). A host
        of very many ranks with many metrics sends their step, loss and rate without the other
        values rather than a report past the wire's frame limit."""
        out = [p.record(now) for _, p in sorted(self.ranks.items()) if p.out is not None]
        if sum(len(r.get("values") or ()) for r in out) * 48 > REPORT_VALUES:
            for r in out:
                r.pop("values", None)
        return out


# --------------------------------------------------------------------------- the head's side

def _step(p, step, epoch):
    """A progress line of step `step` (of `epoch`): the steps it adds to p.total."""
    if p.step is not None and epoch == p.epoch and step > p.step:
        add = min(step - p.step, 1 << 30)
    else:
        add = 1   # the first, or a counter that restarted (a new epoch)
    p.step, p.epoch = step, epoch
    p.records += 1
    return add


def _value(v):
    if v is None or v in ("nan", "inf", "-inf"):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError("a number expected")
    return v


def parse_progress(items: Any, error: Callable[[str], Exception]) -> list[dict[str, Any]]:
    """A member's `progress` list, every field checked; `error(text)` makes the exception to raise."""
    if items is None:
        return []
    if not isinstance(items, list) or len(items) > 4096:
        raise error("field 'progress': a list of at most 4096 records expected")
    out: list[dict[str, Any]] = []
    for x in items:
        if not isinstance(x, dict) or isinstance(x.get("rank"), bool) or not isinstance(x.get("rank"), int):
            raise error("a progress record must be an object with an integer rank")
        rec: dict[str, Any] = {"rank": x["rank"]}
        try:
            for k in ("step", "epoch", "loss", "total", "records", "rate", "out", "t_step"):
                rec[k] = _value(x.get(k))
            vals = x.get("values") or {}
            if not isinstance(vals, dict) or len(vals) > MAX_VALUES:
                raise ValueError("values: at most %d" % MAX_VALUES)
            if vals:
                rec["values"] = {}
                for k, v in vals.items():
                    if not name_ok(k):
                        raise ValueError("a metric name %r" % str(k)[:40])
                    rec["values"][k] = _value(v)
        except ValueError as exc:
            raise error("progress of rank %d: %s" % (x["rank"], exc)) from None
        out.append(rec)
    return out


def merge(doc: dict[str, Any], rank_host: dict[int, str], host: str, items: Any) -> None:
    """A host's progress records -> doc["progress"] (keyed by the rank, as a string): only the
    ranks of that host."""
    if doc.get("progress_attempt") != doc.get("attempt"):   # a new attempt: its own figures only
        doc["progress"], doc["progress_attempt"] = {}, doc.get("attempt")
    prog = doc.setdefault("progress", {})
    for x in items or ():
        if rank_host.get(x["rank"]) == host:
            prog[str(x["rank"])] = x


def records(fh, user=None, limit=256 << 20):
    """Every progress line of a rank's log (a binary file object), in order, as the supervisor
    reads them: {"total", "step", "epoch", "loss", "values"} after each line that moved the step
    or the loss (what `orch report` and metrics.jsonl keep). At most `limit` bytes are read."""
    pr = Progress(user)
    p = RankProgress(0)
    read = 0
    while read < limit:
        chunk = fh.read(min(1 << 20, limit - read))
        if not chunk:
            break
        read += len(chunk)
        for line in chunk.splitlines(True):
            before = (p.records, p.loss)
            pr.feed(p, line, 0.0)
            if (p.records, p.loss) != before:
                rec = {"total": p.total, "step": p.step, "epoch": p.epoch, "loss": p.loss}
                if p.values:
                    rec["values"] = dict(p.values)
                yield rec
