"""Run a function on many hosts: at most `limit` at once, each within a timeout.

Failures stay values: the result maps every host name to an Outcome holding a
value or an OrchError, and fan_out never raises midway (except KeyboardInterrupt,
after which no new host is started). A host that overruns its timeout is
reported as timed out and no longer waited for; its slot is handed to a new
worker so a stuck host never slows the others down.

    res = fan_out(hosts, fn, limit=cluster.ssh.fanout)
    res.raise_if_failed(LaunchError, "could not start on {n} host(s)")   # the caller decides
    values = res.succeeded
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar

from .errors import HostError, OrchError, RemoteTimeout
from .model import Host

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    host: Host
    value: T | None = None
    error: OrchError | None = None
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


SHOWN_ERRORS = 20  # a brief failure list names at most this many hosts


class Results(dict, Generic[T]):
    """{host name: Outcome} in the order of the hosts, with the failures at hand (fabric's
    GroupResult): `.failed` / `.succeeded`, and `.raise_if_failed(...)` for the caller that
    cannot go on without every host."""

    @property
    def failed(self) -> dict[str, OrchError]:
        """{host name: its error}, for the hosts that failed."""
        return {n: o.error for n, o in self.items() if o.error is not None}

    @property
    def succeeded(self) -> dict[str, T]:
        """{host name: its value}, for the hosts that did not fail."""
        return {n: o.value for n, o in self.items() if o.error is None}

    def raise_if_failed(self, error: Callable[..., OrchError], message: str, *, hint: str | None = None,
                        brief: bool = False) -> Results[T]:
        """Raise `error(message + the failures, hint=hint)` when some host failed; `{n}` in the
        message is the number of hosts that did. Each failure on its own line: in full, or
        (`brief`) its first line, at most SHOWN_ERRORS of them; each as it was, in its `by_host`.
        Returns self when none did."""
        by_host = self.failed
        failed = list(by_host.values())
        if not failed:
            return self
        if brief:
            lines = [f"  - {str(e).splitlines()[0]}" for e in failed[:SHOWN_ERRORS]]
            if len(failed) > SHOWN_ERRORS:
                lines.append(f"  - ... and {len(failed) - SHOWN_ERRORS} more")
        else:
            lines = [f"  {e}" for e in failed]
        exc = error(message.replace("{n}", str(len(failed))) + ":\n" + "\n".join(lines), hint=hint)
        exc.by_host = by_host
        raise exc


def fan_out(hosts: Iterable[Host], fn: Callable[[Host], T], *, limit: int = 64,
            timeout: float | None = None,
            on_done: Callable[[Outcome[T]], None] | None = None) -> Results[T]:
    """Call fn(host) for every host, `limit` at a time. Returns {host.name: Outcome} (Results),
    in the order of `hosts`."""
    hosts = list(hosts)
    todo: queue.SimpleQueue[Host] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[Outcome[T], int]] = queue.SimpleQueue()
    cancel = threading.Event()
    started: dict[str, float] = {}
    lock = threading.Lock()
    for h in hosts:
        todo.put(h)

    def worker() -> None:
        while not cancel.is_set():
            try:
                h = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.monotonic()
            with lock:
                started[h.name] = t0
            try:
                out: Outcome[T] = Outcome(h, value=fn(h), duration=time.monotonic() - t0)
            except OrchError as exc:
                out = Outcome(h, error=exc, duration=time.monotonic() - t0)
            except BaseException as exc:  # noqa: BLE001 - a bug on one host must not hide the others
                out = Outcome(h, error=HostError(h.name, f"{type(exc).__name__}: {exc}"),
                              duration=time.monotonic() - t0)
            done.put((out, threading.get_ident()))

    def start_worker() -> None:
        threading.Thread(target=worker, daemon=True, name="orch-fanout").start()

    for _ in range(min(max(1, limit), len(hosts))):
        start_worker()

    results: dict[str, Outcome[T]] = {}
    try:
        while len(results) < len(hosts):
            try:
                out, _ = done.get(timeout=0.05 if timeout is not None else 0.5)
            except queue.Empty:
                out = None
            if out is not None:
                if out.host.name not in results:  # a late answer from a timed-out host is dropped
                    results[out.host.name] = out
                    if on_done:
                        on_done(out)
            if timeout is None:
                continue
            now = time.monotonic()
            with lock:
                overdue = [n for n, t0 in started.items() if n not in results and now - t0 > timeout]
            for name in overdue:
                h = next(x for x in hosts if x.name == name)
                late: Outcome[T] = Outcome(h, error=RemoteTimeout(name, f"no answer within {timeout:g}s"),
                                           duration=now - started[name])
                results[name] = late
                if on_done:
                    on_done(late)
                start_worker()  # the stuck thread keeps its slot busy: replace it
    except BaseException:
        cancel.set()
        raise
    return Results((h.name, results[h.name]) for h in hosts)
