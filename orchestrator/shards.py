"""fan_out over several processes: past ~128 hosts one Python process is one core's worth of SSH
(paramiko's handshake and packets run under one GIL, ~10 ms of CPU per host), so the hosts are
split between this process and forked copies of it, each running the same fan_out on its share
and streaming every host's Outcome back as a JSON line. The caller sees one Results, in the
order of the hosts, and its on_done is called in this thread only, as with fan_out.

    res = fan_out_procs(hosts, fn, procs=2, encode=..., decode=..., limit=64, timeout=t,
                        keep={"node01"}, gate=ready, gate_timeout=1.0, child_fn=fn2)

- The forks are made before any host is touched (fn must open its own connections: a Pool
  still empty, as `orch check` has); each exits with os._exit and never returns to the caller.
- `limit` stays the total: each process gets its share of it.
- `keep`: hosts that stay in this process (they are the ones `gate` waits for); the children
  start their hosts once `gate` is set, or after `gate_timeout` seconds, and call `child_fn`
  (default fn) on them, then `child_exit` (closing their connections) once every host's
  outcome is sent.
- `late`: called in this process once the gate is open; what it returns (bytes) goes to every
  child, where `child_late` gets it (from a thread of its own, while the child's hosts already
  connect): a value only this process's hosts can learn (orch check's reach listener).
- A child that dies, or goes past its deadline (its hosts' timeouts, one round per `limit`
  share, plus one), does not lose its hosts: each one it had not reported is an error naming
  the worker process.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import signal
import threading
import time
from typing import AbstractSet, Any, Callable, Sequence, TypeVar

from . import errors
from .errors import HostError, OrchError
from .fanout import Outcome, Results, fan_out
from .model import Host

T = TypeVar("T")

ENV = "ORCH_FANOUT_PROCS"  # processes for a big fan-out: unset = auto, 1 = this one only
HOSTS_PER_PROC = 128


def procs_for(n_hosts: int) -> int:
    """How many processes fan out to n_hosts: ORCH_FANOUT_PROCS if set, else one per
    HOSTS_PER_PROC hosts (rounded up), at most one per core this process may run on."""
    raw = os.environ.get(ENV, "").strip()
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            raise errors.UsageError(f"{ENV}={raw!r}: not a number of processes", hint=f"unset it, or set "
                                    f"{ENV}=1 to fan out from one process") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(n_hosts / HOSTS_PER_PROC)))


def encode_error(err: OrchError) -> dict:
    return {"type": type(err).__name__, "message": err.message, "hint": err.hint,
            "host": getattr(err, "host", None)}


def decode_error(rec: dict) -> OrchError:
    """The error encode_error wrote, as the same type with the same message, hint and host; a
    type whose __init__ keeps more than those (SpecError's problems) comes back as its base, so
    no attribute is ever missing."""
    cls = getattr(errors, rec.get("type") or "", None)
    base = HostError if rec.get("host") else OrchError
    if not (isinstance(cls, type) and issubclass(cls, base) and cls.__init__ is base.__init__):
        cls = base
    err = cls.__new__(cls)
    Exception.__init__(err, rec["message"])
    err.message, err.hint = rec["message"], rec.get("hint")
    if isinstance(err, HostError):
        err.host, err.result = rec.get("host", ""), None
    return err


def _split(hosts: Sequence[Host], procs: int, keep: set[str]) -> list[list[Host]]:
    """procs shares, round robin; the `keep` hosts in the first (this process's)."""
    shares: list[list[Host]] = [[] for _ in range(procs)]
    i = 0
    for h in hosts:
        if h.name in keep:
            shares[0].append(h)
        else:
            shares[i % procs].append(h)
            i += 1
    return shares


def fan_out_procs(hosts: Sequence[Host], fn: Callable[[Host], T], *, procs: int,
                  encode: Callable[[T], Any], decode: Callable[[Host, Any], T], limit: int = 64,
                  timeout: float | None = None, on_done: Callable[[Outcome[T]], None] | None = None,
                  keep: AbstractSet[str] = frozenset(), gate: threading.Event | None = None, gate_timeout: float = 0.0,
                  child_fn: Callable[[Host], T] | None = None,
                  child_exit: Callable[[], None] | None = None, late: Callable[[], bytes] | None = None,
                  child_late: Callable[[bytes], None] | None = None) -> Results[T]:
    hosts = list(hosts)
    split = _split(hosts, max(1, procs), set(keep))
    shares = split[:1] + [s for s in split[1:] if s]
    if len(shares) < 2:
        return fan_out(hosts, fn, limit=limit, timeout=timeout, on_done=on_done)
    limits = [max(1, limit * len(s) // len(hosts)) for s in shares]
    by_name = {h.name: h for h in hosts}
    children = [_fork(share, child_fn or fn, encode, lim, timeout, gate_timeout, child_exit, child_late)
                for share, lim in zip(shares[1:], limits[1:])]
    done: queue.SimpleQueue = queue.SimpleQueue()
    results: dict[str, Outcome[T]] = {}
    try:
        if gate is not None or late is not None:
            threading.Thread(target=_open_gate, args=(gate, gate_timeout, children, late), daemon=True,
                             name="orch-gate").start()
        else:
            _open_gate(None, 0, children)
        for child, share, lim in zip(children, shares[1:], limits[1:]):
            rounds = math.ceil(len(share) / lim) + 1
            deadline = None if timeout is None else time.monotonic() + gate_timeout + rounds * timeout
            threading.Thread(target=_read_child, args=(child, share, by_name, decode, deadline, done),
                             daemon=True, name="orch-shard").start()
        def own_share() -> None:  # this process's hosts; whatever it raises is raised below, not lost
            try:
                done.put(("own", fan_out(shares[0], fn, limit=limits[0], timeout=timeout,
                                         on_done=lambda o: done.put(("one", o)))))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the loop below
                done.put(("raise", exc))

        threading.Thread(target=own_share, daemon=True, name="orch-shard").start()
        own_ended = False
        while len(results) < len(hosts) or not own_ended:
            kind, item = done.get()
            if kind == "own":
                own_ended = True
                continue
            if kind == "raise":
                raise item
            if item.host.name not in results:
                results[item.host.name] = item
                if on_done:
                    on_done(item)
    except BaseException:
        for c in children:
            _kill(c["pid"])
        raise
    return Results((h.name, results[h.name]) for h in hosts)


def _fork(share: list[Host], fn, encode, limit: int, timeout, gate_timeout: float, child_exit,
          child_late=None) -> dict:
    out_r, out_w = os.pipe()
    gate_r, gate_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its share, then exit; never back into the caller
        code = 1
        try:
            os.close(out_r)
            os.close(gate_w)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the parent reports it, once
            opened = bool(select.select([gate_r], [], [], gate_timeout)[0]) and os.read(gate_r, 1) == b"g"
            if child_late is not None:  # what follows the gate's byte (until EOF) is `late`'s
                threading.Thread(target=_read_late, args=(gate_r, child_late, not opened), daemon=True,
                                 name="orch-late").start()
            wfile = os.fdopen(out_w, "w", buffering=1)

            def send(o: Outcome) -> None:
                rec = {"host": o.host.name, "duration": o.duration}
                if o.error is not None:
                    rec["error"] = encode_error(o.error)
                else:
                    rec["value"] = encode(o.value)
                wfile.write(json.dumps(rec) + "\n")

            fan_out(share, fn, limit=limit, timeout=timeout, on_done=send)
            wfile.close()  # every host answered: the parent need not wait for what follows
            code = 0
            if child_exit is not None:
                child_exit()
        except BaseException:  # noqa: BLE001 - the parent reports the hosts this child did not
            pass
        os._exit(code)
    os.close(out_w)
    os.close(gate_r)
    return {"pid": pid, "out": out_r, "gate": gate_w}


def _open_gate(gate: threading.Event | None, gate_timeout: float, children: list[dict],
               late: Callable[[], bytes] | None = None) -> None:
    if gate is not None:
        gate.wait(gate_timeout)
    for c in children:
        try:
            os.write(c["gate"], b"g")
        except OSError:  # that child is gone already: its reader says so
            pass
    data = late() if late is not None else b""
    for c in children:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(c["gate"], view):]
        except OSError:
            pass
        os.close(c["gate"])


def _read_late(fd: int, child_late: Callable[[bytes], None], gate_byte_first: bool) -> None:
    """In a child: everything after the gate's byte (still in the pipe when the child stopped
    waiting for it first), until the parent closes the pipe."""
    data = b""
    try:
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    child_late(data[1:] if gate_byte_first and data[:1] == b"g" else data)


def _read_child(child: dict, share: list[Host], by_name: dict, decode, deadline: float | None,
                done: queue.SimpleQueue) -> None:
    seen: set[str] = set()
    buf = b""
    fd = child["out"]
    why: str | None
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                _kill(child["pid"])
                why = "went past its deadline and was stopped"
                break
            data = os.read(fd, 1 << 16)
            if not data:
                why = None
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                rec = json.loads(line)
                h = by_name[rec["host"]]
                o: Outcome[Any]
                if "error" in rec:
                    o = Outcome(h, error=decode_error(rec["error"]), duration=rec["duration"])
                else:
                    o = Outcome(h, value=decode(h, rec["value"]), duration=rec["duration"])
                seen.add(h.name)
                done.put(("one", o))
        status = _reap(child["pid"])
        if why is None:
            why = "ended early" + (f" ({status})" if status else "")
    except BaseException as exc:  # noqa: BLE001 - a bad line: the hosts left are reported below
        _kill(child["pid"])
        _reap(child["pid"])
        why = f"sent what this process could not read ({type(exc).__name__}: {exc})"
    finally:
        os.close(fd)
    for h in share:
        if h.name not in seen:
            done.put(("one", Outcome(h, error=HostError(
                h.name, f"the worker process {child['pid']} fanning out to this host {why} before it answered"))))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _reap(pid: int) -> str:
    """Wait for the child; '' when it exited 0, else its exit code or signal."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return ""
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "" if code == 0 else f"exit code {code}"
