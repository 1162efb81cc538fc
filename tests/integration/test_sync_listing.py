"""`orch up`'s sync by what the check probe listed on each host (no listing round trip of its
own), through the launch host (mpirun's default job.sync_via) and directly: what lands is the
tree as it is when the sync runs, a file edited between the probe and the sync included."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from orchestrator import checks, sync
from orchestrator.fanout import fan_out
from orchestrator.spec import load_cluster
from orchestrator.transport import Pool
from orchestrator.transport.ssh import SshTransport
from tests.support import write_cluster


def _sync(c, pool, listed):
    entries = sync.manifest(c.base_dir, c.job.sync, str(c.path), c.job.sync_exclude)
    hosts = list(c.hosts)
    res = sync.sync_hosts(pool, hosts, hosts[0], c.job.workdir, entries, {hosts[0].name: {"hostfile": b"h\n"}},
                          via=c.job.sync_via, ssh=c.ssh, listed=listed,
                          fan=lambda hs, fn: fan_out(hs, fn, limit=c.ssh.fanout))
    res.raise_if_failed(RuntimeError, "sync failed")
    return res


@pytest.mark.parametrize("via", ["launch-host", "controller"])
def test_sync_after_the_probes_listing_writes_the_tree_as_it_is_now(lab, tmp_path, monkeypatch, via):
    src = tmp_path / "pkg"
    src.mkdir()
    for name in ("a.py", "b.py"):
        (src / name).write_text(f"{name} = 1\n")
    workdir = f"/data/synclist-{via}-{os.getpid()}"
    c = load_cluster(write_cluster(lab, tmp_path, workdir=workdir, launcher="mpirun", sync=["pkg"], sync_via=via,
                                   checks={"skip": ["mesh", "reach"]}))
    runs: Counter = Counter()
    real = SshTransport.run

    def counted(self, *a, **k):
        runs[self.host.name] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(SshTransport, "run", counted)
    with Pool(c) as pool:
        report = checks.run_checks(c, pool, prepare=True)
        assert sorted(report.listed) == sorted(h.name for h in c.hosts)
        runs.clear()
        _sync(c, pool, report.listed)  # nothing there yet
        # the streams only, no listing: to the launch host, which passes it on; or to each host
        assert runs == (Counter({c.hosts[0].name: 1}) if via == "launch-host" else Counter(h.name for h in c.hosts))
        report = checks.run_checks(c, pool, prepare=True)
        # edited here between the probe and the sync, same size: the listing is stale for it
        (src / "a.py").write_text("a.py = 2\n")
        os.utime(src / "a.py", ns=(10**9, 10**9))
        runs.clear()
        got = _sync(c, pool, report.listed)
        assert all(o.value.copied == ("pkg/a.py",) for o in got.values())
        assert runs == (Counter({c.hosts[0].name: 1}) if via == "launch-host" else Counter(h.name for h in c.hosts))
        for h in c.hosts:
            r = pool[h].run(["cat", f"{workdir}/pkg/a.py", f"{workdir}/pkg/b.py"]).check("cat")
            assert r.out == "a.py = 2\nb.py = 1\n", h.name
        for h in c.hosts:
            pool[h].run(["rm", "-rf", workdir])
