"""SSH failure modes become clear orch errors, with the right retry behaviour (real sshd)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from orchestrator.errors import AuthError, HostKeyError, TransientNetworkError
from orchestrator.fanout import fan_out
from orchestrator.transport import Pool, make_transport

from tests.support import budget, lab_cluster, timed

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def flaky(lab_factory):
    """4 hosts: h2 refuses the lab key."""
    return lab_factory("f", 4, refuse_key=[2])


def test_auth_refused_names_user_host_key_and_is_not_retried(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path, ssh={"retries": 3, "connect_timeout": 5})
    h2 = c.hosts[1]
    _, healthy = timed(make_transport(c.hosts[0], c.ssh).run, ["true"])  # a fresh connection that works
    t = make_transport(h2, dataclasses.replace(c.ssh, retries=3))
    before = flaky.sshd_log(2).read_text().count("Failed publickey") if flaky.sshd_log(2).exists() else 0
    t0 = time.monotonic()
    with pytest.raises(AuthError) as ei:
        t.run(["true"])
    assert time.monotonic() - t0 < budget(healthy, 0)  # no connect_timeout (5 s) waited out
    msg = str(ei.value)
    assert f"root@{h2.address}" in msg and h2.identity_file in msg and "ssh-copy-id" in msg
    after = flaky.sshd_log(2).read_text().count("Failed publickey")
    assert after - before == 1, "an auth failure must not be retried"


def test_unknown_host_key_strict_refused_with_fingerprint(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path)
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    h = dataclasses.replace(c.hosts[0], known_hosts=str(kh))
    with pytest.raises(HostKeyError) as ei:
        make_transport(h, c.ssh).run(["true"])
    msg = str(ei.value)
    assert "not in" in msg and "SHA256:" in msg and "ssh-keyscan" in msg and "accept-new" in msg
    assert kh.read_text() == ""


def test_unknown_host_key_accept_new_is_recorded_then_verified(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path)
    kh = tmp_path / "known_hosts"
    h = dataclasses.replace(c.hosts[0], known_hosts=str(kh))
    ssh = dataclasses.replace(c.ssh, host_key_policy="accept-new")
    assert make_transport(h, ssh).run(["true"]).ok
    assert h.address in kh.read_text()
    # recorded: now accepted under strict too
    assert make_transport(h, c.ssh).run(["true"]).ok


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_host_key_refused_under_every_policy(flaky, tmp_path, policy):
    c = lab_cluster(flaky, tmp_path)
    h1, h3 = c.hosts[0], c.hosts[2]
    lines = flaky.known_hosts_path.read_text().splitlines()
    other_key = next(ln for ln in lines if ln.split()[0].split(",")[0] == h3.address).split(None, 1)[1]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{h1.address} {other_key}\n")  # h1 "now" has h3's key on file
    h = dataclasses.replace(h1, known_hosts=str(kh))
    with pytest.raises(HostKeyError) as ei:
        make_transport(h, dataclasses.replace(c.ssh, host_key_policy=policy)).run(["true"])
    msg = str(ei.value)
    assert "HOST KEY CHANGED" in msg and "man-in-the-middle" in msg and "ssh-keygen -R" in msg
    assert kh.read_text() == f"{h1.address} {other_key}\n"


def test_dead_host_costs_at_most_timeout_times_retries_and_others_answer(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path, ssh={"connect_timeout": 1, "retries": 2})

    def hostnames():
        """fan_out over fresh connections: (results, seconds each host took, seconds in all)."""
        with Pool(c) as pool:
            t0 = time.monotonic()
            done = {}

            def fn(h):
                r = pool[h].run(["hostname"])
                done[h.name] = time.monotonic() - t0
                return r.out.strip()

            res = fan_out(c.hosts, fn, limit=4)
            return res, done, time.monotonic() - t0

    _, healthy_done, healthy_total = hostnames()
    flaky.link(4, False)
    try:
        res, done, total = hostnames()
    finally:
        flaky.link(4, True)
    dead = c.hosts[3].name
    assert isinstance(res[dead].error, TransientNetworkError)
    assert "could not connect" in str(res[dead].error) or "timed out" in str(res[dead].error)
    assert res[c.hosts[0].name].value == flaky.host(1).name
    assert isinstance(res[c.hosts[1].name].error, AuthError)
    print(f"healthy {healthy_total:.1f}s, with a dead host {total:.1f}s (1 s x 2 attempts)")
    assert total < budget(healthy_total, 1 * 2), f"dead host took {total:.1f}s"
    live = [c.hosts[0].name, c.hosts[2].name]
    assert max(done[n] for n in live) < budget(max(healthy_done[n] for n in live), 0), \
        "live hosts were delayed by the dead one"


def test_sshd_stopped_is_refused_quickly_then_back(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path, ssh={"connect_timeout": 2, "retries": 3})
    _, healthy = timed(make_transport(c.hosts[2], c.ssh).run, ["true"])
    flaky.sshd(3, False)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransientNetworkError, match="refused"):
            make_transport(c.hosts[2], c.ssh).run(["true"])
        assert time.monotonic() - t0 < budget(healthy, 0.2 + 0.4)  # the backoff between 3 attempts, no timeout
    finally:
        flaky.sshd(3, True)
    assert make_transport(c.hosts[2], c.ssh).run(["true"]).ok


def test_one_connection_per_host_for_many_operations(flaky, tmp_path):
    c = lab_cluster(flaky, tmp_path)
    before = flaky.sshd_log(1).read_text().count("Accepted publickey")
    with Pool(c) as pool:
        t = pool[c.hosts[0]]
        for i in range(5):
            t.run(["true"])
            t.put(b"x", f"/data/one-conn/{i}")
        t.get("/data/one-conn/0", tmp_path / "got")
        assert pool[c.hosts[0].name] is t
    after = flaky.sshd_log(1).read_text().count("Accepted publickey")
    assert after - before == 1
