"""Bounded fan-out: concurrency limit, per-host timeout, failures as values."""

from __future__ import annotations

import threading
import time

import pytest

from orchestrator.errors import AuthError, HostError, RemoteTimeout
from orchestrator.fanout import fan_out
from orchestrator.spec import Host


def hosts(n):
    return [Host(name=f"h{i}", address=f"10.9.0.{i}", user="u") for i in range(n)]


def test_bounded_concurrency_and_order():
    active, peak, lock = [0], [0], threading.Lock()

    def fn(h):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return h.name.upper()

    res = fan_out(hosts(20), fn, limit=4)
    assert list(res) == [f"h{i}" for i in range(20)]
    assert all(o.ok and o.value == name.upper() for name, o in res.items())
    assert peak[0] == 4


def test_failures_stay_values():
    def fn(h):
        if h.name == "h1":
            raise AuthError(h.name, "refused")
        if h.name == "h2":
            raise RuntimeError("boom")
        return 1

    res = fan_out(hosts(4), fn, limit=2)
    assert isinstance(res["h1"].error, AuthError)
    assert isinstance(res["h2"].error, HostError) and "boom" in str(res["h2"].error)
    assert res["h0"].value == 1 and res["h3"].value == 1


def test_stuck_host_times_out_without_delaying_others():
    release = threading.Event()

    def fn(h):
        if h.name == "h0":
            release.wait(10)
        return h.name

    seen = []
    t0 = time.monotonic()
    res = fan_out(hosts(6), fn, limit=1, timeout=0.3, on_done=lambda o: seen.append(o.host.name))
    elapsed = time.monotonic() - t0
    release.set()
    assert isinstance(res["h0"].error, RemoteTimeout)
    assert all(res[f"h{i}"].value == f"h{i}" for i in range(1, 6))
    assert sorted(seen) == sorted(res)
    assert elapsed < 5  # generous: the point is that h0 did not block the queue for 10 s


def test_keyboard_interrupt_stops_new_hosts():
    """After Ctrl-C no worker takes another host: h0 and h1 return at once, the next host each
    worker takes blocks until the interrupt has been raised, and then no further host starts."""
    started, release = [], threading.Event()

    def fn(h):
        started.append(h.name)
        if h.name not in ("h0", "h1"):
            release.wait(10)

    def on_done(o):  # Ctrl-C arrives in the main thread while it collects results
        if o.host.name == "h1":
            raise KeyboardInterrupt

    before = set(threading.enumerate())
    with pytest.raises(KeyboardInterrupt):
        fan_out(hosts(50), fn, limit=2, on_done=on_done)
    release.set()
    for t in set(threading.enumerate()) - before:  # the workers finish what they hold, then stop
        t.join(10)
    assert len(started) <= 4, started


def test_results_failed_succeeded_and_raise_if_failed():
    """The result map keeps failures as values until the caller asks: .failed, .succeeded, and
    .raise_if_failed naming every failing host (briefly: first lines, at most 20, then a count)."""
    from orchestrator.errors import OrchError, PlanError

    def fn(h):
        if int(h.name[1:]) % 2:
            raise HostError(h.name, "no route\nsecond line")
        return h.name

    res = fan_out(hosts(50), fn, limit=8)
    assert list(res.succeeded) == [f"h{i}" for i in range(0, 50, 2)] and res.succeeded["h4"] == "h4"
    assert list(res.failed) == [f"h{i}" for i in range(1, 50, 2)]
    with pytest.raises(PlanError) as exc:
        res.raise_if_failed(PlanError, "could not read it on {n} host(s)", hint="fix it", brief=True)
    lines = exc.value.message.splitlines()
    assert lines[0] == "could not read it on 25 host(s):" and lines[1] == "  - h1: no route"
    assert len(lines) == 22 and lines[-1] == "  - ... and 5 more" and exc.value.hint == "fix it"
    with pytest.raises(OrchError) as exc:
        res.raise_if_failed(OrchError, "every host")
    assert exc.value.message.startswith("every host:\n  h1: no route\nsecond line\n  h3: ")
    # each host's own error, as it was raised there (a caller decides by its kind)
    assert exc.value.by_host == res.failed and isinstance(exc.value.by_host["h1"], HostError)
    assert OrchError("one").by_host == {}
    ok = fan_out(hosts(3), lambda h: 1)
    assert ok.raise_if_failed(PlanError, "never") is ok and ok.failed == {}
