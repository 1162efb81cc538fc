"""The agent package's name and its compressed copy are computed once per controller process,
whichever threads ask at the same time, and a check never compresses the package at all.

Every probe of `orch check` and `orch up` names the package's directory (agent_home_name) as its
fan-out thread starts; zlib and hashlib let go of the GIL while they work, so with a plain
lru_cache every thread that asked before the first answer computed it again (a 32-host check
compressed the 240 KB package 31 times at level 9: ~0.45 s of the controller's CPU)."""

from __future__ import annotations

import base64
import json
import threading
import time
import zlib
from dataclasses import replace

import pytest

from orchestrator import probes, supervisor
from orchestrator.checks.checkplan import make_check_plan
from orchestrator.checks.runner import probe_script
from orchestrator.spec import load_cluster

ONCE = (supervisor._agent_json, supervisor.agent_home_name, supervisor.agent_blob)


@pytest.fixture
def fresh():
    """Every cached value computed anew in the test, and again (with the real zlib) after it."""
    for f in ONCE:
        f.cache_clear()
    yield
    for f in ONCE:
        f.cache_clear()


def test_threads_asking_at_once_compress_the_package_once(fresh, monkeypatch):
    calls, real = [], zlib.compress

    def slow_compress(data, level=-1):
        calls.append(threading.get_ident())
        time.sleep(0.05)  # as the real one, without the GIL: every other thread runs meanwhile
        return real(data, level)

    monkeypatch.setattr(supervisor.zlib, "compress", slow_compress)
    start = threading.Barrier(16, timeout=10)
    got: list[tuple[str, str]] = []

    def ask():
        start.wait()
        got.append((supervisor.agent_home_name(), supervisor.agent_blob()))

    threads = [threading.Thread(target=ask, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert len(got) == 16 and len(set(got)) == 1
    assert len(calls) == 1


def test_a_check_names_the_package_without_compressing_it(fresh, monkeypatch, tmp_path):
    def refuse(*_a, **_k):
        raise AssertionError("a check compressed the agent package")

    monkeypatch.setattr(supervisor.zlib, "compress", refuse)
    (tmp_path / "cluster.yaml").write_text(
        "name: t\n"
        "inventory:\n  defaults: {user: u, slots: 1}\n  hosts:\n    - address: 10.9.0.[1-3]\n"
        "job: {launcher: mpirun, platform: cpu, workdir: /data/w, command: python3 t.py}\n")
    cluster = load_cluster(tmp_path / "cluster.yaml")
    # each probe as `orch check` sends it once the launch host's listener is known (the others'
    # reach test runs its code from the package's directory, so it names it)
    plan = replace(make_check_plan(cluster), reach_token="a" * 64, reach=probes.ReachTarget(43121, ("10.9.0.1",), 0.0))
    scripts = [probe_script(plan, h) for h in plan.hosts]
    assert all(supervisor.agent_home_name() in s for s in scripts[1:])
    monkeypatch.undo()
    # the name is the package's, whatever compresses it: what _BOOT_PY unpacks is those sources
    blob = supervisor.agent_blob()
    assert json.loads(zlib.decompress(base64.b64decode(blob))) == supervisor.agent_sources()
