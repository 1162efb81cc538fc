"""Round trips per host in `orch up` and `orch down` (issue 16, launch overhead): counted on a
real local host (connection: local) through the transport's one `run`, so a round trip added
back shows up here. Timings belong in tests/benchmarks; these count."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import api, lifecycle, prepare
from orchestrator.errors import RunConflict
from orchestrator.transport.local import LocalTransport


@pytest.fixture
def runs(monkeypatch) -> Counter:
    """{host name: `run` calls} of every local transport."""
    got: Counter = Counter()
    real = LocalTransport.run

    def run(self, *a, **k):
        got[self.host.name] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(LocalTransport, "run", run)
    return got


def local_cluster(tmp_path: Path, command: str = "true", extra: str = "", checks: str = ""):
    (tmp_path / "net.py").write_text("print(1)\n")
    f = tmp_path / "cluster.yaml"
    f.write_text(f"""name: rt
inventory:
  defaults: {{connection: local}}
  hosts: [{{address: 127.0.0.1, name: me, slots: 2}}]
job:
  workdir: {tmp_path / 'wd'}
  launcher: ranktable
  command: [sh, -c, {command!r}]
  sync: [net.py]
{extra}checks: {{versions: [python], min_free_gib: 0.001{checks}}}
""")
    return api.load(f)


class BeforeSync(Exception):
    pass


def _up_until_sync(cluster, monkeypatch, runs: Counter, **kw):
    """api.up up to its sync (distribute raises, `runs` then holds up's round trips before it):
    what up learnt before writing anything (prepare.Prepared)."""
    def stop(self, launch, entries, listed=None, share=None):
        captured["before_sync"] = dict(runs)
        raise BeforeSync

    monkeypatch.setattr(lifecycle.Lifecycle, "distribute", stop)
    # the supervisors' starts, which go out beside the sync, left out: the sync alone
    monkeypatch.setattr(lifecycle.Lifecycle, "start", lambda self, launch, have_agent=frozenset(), sync=lambda: None: sync())
    captured = {}
    real = prepare.prepare

    def fake(*a, **k):
        captured["prepared"] = real(*a, **k)
        return captured["prepared"]

    monkeypatch.setattr(prepare, "prepare", fake)
    with pytest.raises(BeforeSync):
        api.up(cluster, show_output=False, **kw)
    runs.clear()
    runs.update(captured["before_sync"])
    return captured["prepared"]


def _up_until_start(cluster, monkeypatch, runs: Counter, **kw) -> int:
    """api.up up to the supervisors' start: the round trips on the host until then (its sync's
    included: the start runs it)."""
    def stop(self, launch, have_agent=frozenset(), sync=lambda: None):
        sync()
        raise BeforeSync

    monkeypatch.setattr(lifecycle.Lifecycle, "start", stop)
    runs.clear()
    with pytest.raises(BeforeSync):
        api.up(cluster, show_output=False, **kw)
    return runs["me"]


def test_up_syncs_by_what_the_check_probe_listed(tmp_path, monkeypatch, runs):
    """The check probe lists what the host has of the sync: sync has no listing round trip of its
    own; with --skip-checks, prepare's round trip lists it."""
    c = local_cluster(tmp_path)
    checked = [_up_until_start(c, monkeypatch, runs) for _ in range(2)]  # the first, then nothing changed
    assert (tmp_path / "wd" / "net.py").read_text() == "print(1)\n"
    (tmp_path / "net.py").write_text("print(2)\n")
    assert _up_until_start(c, monkeypatch, runs) == checked[0]
    assert (tmp_path / "wd" / "net.py").read_text() == "print(2)\n"
    skipped = _up_until_start(c, monkeypatch, runs, skip_checks=True)
    # with checks: the probe, the stream (none the second time); --skip-checks: prepare, which lists too
    # (nothing to stream); each with the one other round trip of up before the start
    assert (checked, skipped) == ([3, 2], 2)
    (tmp_path / "net.py").write_text("print(3)\n")
    assert _up_until_start(c, monkeypatch, runs, skip_checks=True) == 3   # prepare + listing, the stream
    assert (tmp_path / "wd" / "net.py").read_text() == "print(3)\n"


@pytest.mark.parametrize("skip", ["", ", skip: [path, workdir, nic]"])
def test_up_reads_prepare_in_the_check_probe(tmp_path, monkeypatch, runs, skip):
    """up's preflight probe reads prepare's facts too: one round trip per host before the sync
    (two before: the probe and prepare's own), whichever checks run; and what prepare learns is
    what its own round trip (--skip-checks) learns."""
    c = local_cluster(tmp_path, extra="  interface: auto\n", checks=skip)
    monkeypatch.chdir(tmp_path)
    got = _up_until_sync(c, monkeypatch, runs)
    assert runs == {"me": 1}
    runs.clear()
    alone = _up_until_sync(c, monkeypatch, runs, skip_checks=True)
    assert runs == {"me": 1}
    # the same facts; prepare's own round trip lists the sync as well (the probe's listing is the report's)
    assert got == replace(alone, listed={}) and alone.listed == {"me": {"net.py": None}}
    assert got.interfaces == {"me": ("lo", "127.0.0.0/8")}
    assert got.addresses == {"me": "127.0.0.1"}  # the launch host's, where the others reach it (head_reach)


def test_up_one_probe_sees_a_live_run(tmp_path, monkeypatch, runs):
    """The probe reads the workdir's lock as prepare did: a live run there is a RunConflict."""
    import fcntl
    import os

    c = local_cluster(tmp_path)
    lock = tmp_path / "wd" / ".orch" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("20990101-000000-abcdef\n")
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        monkeypatch.chdir(tmp_path)
        with pytest.raises(RunConflict, match="run 20990101-000000-abcdef is still running"):
            _up_until_sync(c, monkeypatch, runs)
    finally:
        os.close(fd)
    assert runs == {"me": 1}


def test_up_hashes_each_sync_file_once(tmp_path, monkeypatch):
    """The check plan's manifest (files check) and the sync hash a file once between them."""
    from orchestrator import checks, sync

    c = local_cluster(tmp_path)
    (tmp_path / "net.py").write_text("print('hashed once')\n")
    hashed = Counter()
    real = sync._sha256

    def sha(path):
        hashed[str(path)] += 1
        return real(path)

    monkeypatch.setattr(sync, "_sha256", sha)
    files, missing, _ = checks.sync_manifest(c)
    assert [f.rel for f in files] == ["net.py"] and not missing
    entries = sync.manifest(c.base_dir, c.job.sync, str(c.path), c.job.sync_exclude)
    assert [sync._digest(e) for e in entries] == [files[0].sha256]
    assert list(hashed.values()) == [1]


def test_down_reads_the_state_in_the_sweeps_round_trip(tmp_path, monkeypatch, runs):
    """`orch down`: ask the head to stop, sweep (which then reads the host's state: no status
    round trip of its own), gather: three round trips on the launch host (four before)."""
    c = local_cluster(tmp_path, command="exec sleep 60")
    monkeypatch.chdir(tmp_path)
    res = api.up(c, detach=True, skip_checks=True, show_output=False)
    assert res.state == "detached"
    runs.clear()
    done, failed, view = api.down(res.run.id, root=tmp_path)
    assert runs == {"me": 3}
    assert failed == {} and set(done) == {"me"}
    assert view.state == "stopped" and {r["state"] for r in view.ranks} == {"stopped"}
    assert api.status(res.run.id, root=tmp_path).state == "stopped"


def test_up_interrupted_reads_the_state_in_the_sweeps_round_trip(tmp_path, monkeypatch, runs):
    """Ctrl-C while following: stop, sweep (with the state), gather; no status round trip."""
    c = local_cluster(tmp_path, command="exec sleep 60")
    monkeypatch.chdir(tmp_path)

    def follow(self):
        runs.clear()
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle.Lifecycle, "follow", follow)
    res = api.up(c, skip_checks=True, show_output=False)
    assert runs == {"me": 3}
    assert res.state == "interrupted" and res.exit_code == 130
    assert res.outcome.view is not None and {r["state"] for r in res.outcome.view.ranks} == {"stopped"}


def test_an_error_quotes_a_hosts_log_as_it_is(tmp_path):
    """lifecycle.said: what a log on a host says (its last lines), that it is empty, or why it
    could not be read: never a guess."""
    from orchestrator.model import Host

    t = LocalTransport(Host(name="me", address="127.0.0.1", user="me", connection="local"), 10)
    log = tmp_path / "batch.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    got = lifecycle.said(t, str(log), 10)
    assert got.startswith("says:\n  line 18\n") and got.endswith("line 29") and "line 17" not in got
    log.write_text("")
    assert lifecycle.said(t, str(log), 10) == "is empty"
    missing = lifecycle.said(t, str(tmp_path / "nope.log"), 10)
    assert missing.startswith("could not be read (") and "No such file" in missing


@pytest.mark.parametrize("listing", ["[garbled", "", "[[\"file\", 1]]"])
def test_prepare_listing_that_fails_hides_no_fact(tmp_path, monkeypatch, listing):
    """--skip-checks: prepare's round trip lists the sync too; a listing that fails or comes back
    garbled is no listing (sync asks that host itself), and every fact is still read."""
    import os

    from orchestrator import sync
    from orchestrator.rankplan import make_plan
    from orchestrator.transport import Pool

    c = local_cluster(tmp_path)
    real = sync.listing_script
    monkeypatch.setattr(prepare, "listing_script",
                        lambda workdir, request, wrap="": f"echo {listing!r}" if listing else "false")
    request = prepare.sync_listing(c, sync.job_manifest(c))
    with Pool(c) as pool:
        got = prepare.prepare(c, make_plan(c), pool, listing=request)
        assert got.listed == {} and got.root == {"me": prepare.is_root(uid=os.getuid())}
        monkeypatch.setattr(prepare, "listing_script", real)
        assert prepare.prepare(c, make_plan(c), pool, listing=request).listed == {"me": {"net.py": None}}
