"""Check reach: every host reaches the launch host by TCP on a cluster-side address.

The parsers and judges against sections captured on lab hosts (tests/fixtures/checks/reach/:
a launch host with a second address, a host with a blackhole / unreachable / prohibit route or an
unanswered ARP towards the launch host's address); the listener and a host's test for real, on
loopback only; the relay from the launch host's probe to the others' (and to forked fan-out
processes); run_checks sending the others' probes once the listener is known.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import checks, prepare, probes, shards, supervisor, sync
from orchestrator.checks import reach, runner
from orchestrator.probes import Listen, ProbeError, ReachTarget, Section
from orchestrator.spec import Checks, Cluster, Host, Job, SshSettings
from orchestrator.transport.base import Transport

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "checks" / "reach"
LAUNCH = "198.18.149.11"


def fx(name: str) -> Section:
    return probes.split_sections((FIX / name).read_text())["reach"]


def host(i: int, **kw) -> Host:
    return Host(**{"name": f"rchx1-h{i}", "address": f"198.18.149.{10 + i}", "user": "root", **kw})


def cluster(hosts=None, n: int = 3, skip=(), **job) -> Cluster:
    return Cluster(name="t", path=Path("/nonexistent/cluster.yaml"), hosts=tuple(hosts or [host(i) for i in
                                                                                           range(1, n + 1)]),
                   job=Job(workdir="/data/job", command=("python3", "t.py"), launcher="ranktable", **job),
                   ssh=SshSettings(connect_timeout=2, retries=2, command_timeout=30), checks=Checks(skip=skip))


def plan_of(c: Cluster, **kw):
    return replace(checks.make_check_plan(c), **kw)


# --------------------------------------------------------------------------- one python3 start per host


PY_START = "python3 -S -c"  # how the probe starts python3 (hostlayout.PY), in path's section and reach's


def test_where_the_reach_test_runs_it_says_the_supervisors_python3_version_for_check_path():
    """A host whose reach test runs (the launch host's listener known) starts python3 once, not
    twice: the test's python3 (the supervisor's: -S, the plain PATH) prints the version check path
    reads, and path's section starts none of its own (~9 ms of CPU on every host); in `orch up`
    it reads what prepare reads with it too (the workdir's lock, the agent package). The launch
    host, a probe made without the listener (`--print-probe`) and reach skipped keep path's own."""
    c = cluster(n=3)
    launch, other = c.hosts[0], c.hosts[1]
    p = plan_of(c, reach=ReachTarget(43121, (LAUNCH,), 0.0))
    script = checks.probe_script(p, other)
    assert script.count(PY_START) == 1 and reach.tests_by_python(p, other)
    assert "supervisor" not in checks.check_script(p, other, checks.base.check("path"))
    assert "supervisor" in checks.check_script(p, launch, checks.base.check("path")) and not reach.tests_by_python(p, launch)
    assert checks.probe_script(p, launch).count(PY_START) == 2   # the listener, and path's
    unknown = plan_of(c)   # --print-probe: the listener is known only while orch check runs
    assert checks.probe_script(unknown, other).count(PY_START) == 1 and not reach.tests_by_python(unknown, other)
    assert "supervisor" in checks.check_script(unknown, other, checks.base.check("path"))
    skipped = plan_of(cluster(n=3, skip=("reach",)), reach=ReachTarget(43121, (LAUNCH,), 0.0))
    assert "supervisor" in checks.check_script(skipped, other, checks.base.check("path"))
    up = replace(checks.make_check_plan(c, prepare=True), reach=ReachTarget(43121, (LAUNCH,), 0.0))
    assert "supervisor" not in checks.check_script(up, other, checks.base.check("path"))
    lock, home = supervisor.lock_path(c), supervisor.agent_home(c)
    assert f"ORCH_FACTS_LOCK={lock} ORCH_FACTS_HOME={home} " in checks.check_script(up, other, checks.base.check("reach"))
    assert f"ORCH_FACTS_LOCK={lock} " in checks.check_script(up, launch, checks.base.check("path"))   # python_sh's
    assert "ORCH_FACTS_LOCK=" not in checks.check_script(p, other, checks.base.check("reach"))   # orch check: no lock read


def test_in_up_the_reach_tests_python3_lists_the_sync_too():
    """`orch up`: a host whose reach test runs python3 lists the sync in it (one python3 start, not
    two: ~7 ms of CPU on every host); its probe has no synclist section. The launch host (its
    listener detaches: a listing there would hold the others' start) and a probe without the
    listener keep the synclist section."""
    c = cluster(n=3)
    launch, other = c.hosts[0], c.hosts[1]
    entries = [sync.Entry("t.py", "file", 0o644, 3, 5)]
    up = replace(checks.make_check_plan(c, prepare=True, entries=entries), reach=ReachTarget(43121, (LAUNCH,), 0.0))
    assert up.listing and reach.lists_sync(up, other) and not reach.lists_sync(up, launch)
    script = checks.probe_script(up, other)
    assert script.count(PY_START) == 1 and "_b synclist" not in script and f"{sync.LIST_ENV}={c.job.workdir} " in script
    assert "_b synclist" in checks.probe_script(up, launch)
    assert "_b synclist" in checks.probe_script(replace(up, reach=None), other)
    assert not reach.lists_sync(plan_of(c, reach=ReachTarget(43121, (LAUNCH,), 0.0)), other)   # orch check


def test_the_reach_test_lists_and_tests_lean_and_its_listing_is_read_from_its_section(tmp_path):
    """The test's program in `orch up` (the facts, the test, then the listing) run here as a host
    runs it: its section says the facts, the test and the listing (read as the synclist section's
    would be); it imports no json, socket or threading; a workdir it cannot list, or a request it
    cannot read, costs the listing only, never the test nor the program's exit code."""
    (tmp_path / "t.py").write_text("x")
    c = cluster(n=3)
    other = c.hosts[1]
    up = replace(checks.make_check_plan(c, prepare=True, entries=[sync.Entry("t.py", "file", 0o644, 1, 5)]),
                 reach=ReachTarget(43121, (LAUNCH,), 0.0))
    request = up.listing
    assert ("t.py", False) in request and reach.lists_sync(up, other)
    env = {**os.environ, reach.ENV_IN: "a" * 32, reach.ENV_OUT: "b" * 32, sync.LIST_ENV: str(tmp_path),
           **supervisor.facts_env(str(tmp_path / ".orch" / "lock"), str(tmp_path / ".orch" / "agent-x"))}
    listener = lean(reach.LISTEN_PY, "3", "20", "0.3", "1", str(reach.READ_LIMIT), "127.0.0.1", env=env)
    port = listener.stdout.strip()
    # what it imported, said as it ends (by os._exit: reach._QUIT)
    prog = ("import os,sys\nquit=os._exit\n"
            "os._exit=lambda c:(print(sorted({'json', 're'} & set(sys.modules)), flush=True),quit(c))\n"
            + reach.connect_program(True, True))
    got = lean(prog, "1", port, "2", "127.0.0.1", env=env, stdin=sync.list_input(request))
    assert got.returncode == 0 and got.stderr == "", got.stderr
    body = without_version(got.stdout)
    assert body.startswith("to 127.0.0.1 ok\norch:list ") and body.endswith("\n[]\n"), body
    st = os.stat(tmp_path / "t.py")
    assert runner.listed(up, other, {"reach": Section("reach", got.stdout, 0)}) == {
        rel: ["file", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), None] if rel == "t.py" else None
        for rel, _ in request}
    assert probes.parse_reach(body).tried == (("127.0.0.1", "ok"),)
    # a workdir that is a file, a request that is not one: no listing (sync asks that host itself)
    (tmp_path / "file").write_text("")
    for workdir, stdin in ((tmp_path / "file", sync.list_input(request)), (tmp_path, "S zz\n")):
        got = lean(reach.connect_program(True, True), "1", port, "2", "127.0.0.1",
                   env={**env, sync.LIST_ENV: str(workdir)}, stdin=stdin)
        assert got.returncode == 0 and "to 127.0.0.1 ok\n" in got.stdout and "orch:list" not in got.stdout, got
        assert runner.listed(up, other, {"reach": Section("reach", got.stdout, 0)}) is None


def test_up_reads_the_lock_and_the_package_from_the_reach_tests_python3(tmp_path):
    """prepare.facts: a host whose path section has no python3 line takes the supervisor's
    version, the live run and the package from its reach section (FACTS_PY ran there); a reach
    section cut off leaves the facts unknown (prepare asks the host itself)."""
    c = cluster(n=3)
    up = replace(checks.make_check_plan(c, prepare=True), reach=ReachTarget(43121, (LAUNCH,), 0.0))
    base = {name: Section(name, "existed=yes\nwrite=ok\nuid=0\n" if name == "workdir" else "PATH=/bin\n", 0)
            for name in set(prepare.sources(up).values())}
    said = prepare.facts(up, {**base, "reach": Section("reach", f"supervisor\t3.11\nlive R9\n{supervisor.AGENT_THERE}\n"
                                                                 f"to {LAUNCH} ok\n", 0)})
    assert said is not None and (said["python"], said["live"], said["agent"]) == ("3.11", "R9", True)
    assert prepare.facts(up, {**base, "reach": Section("reach", "supervisor\t3.11\n", None)}) is None
    # the facts as FACTS_PY prints them, run here: no lock, no package; then a live holder of the lock
    home = tmp_path / ".orch" / "agent-x"
    env = {"PATH": "/usr/bin:/bin", **supervisor.facts_env(str(tmp_path / ".orch" / "lock"), str(home))}
    out = subprocess.run([sys.executable, "-S", "-c", supervisor.FACTS_PY], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    assert out == "supervisor\t%d.%d\n" % sys.version_info[:2]
    home.mkdir(parents=True)
    import fcntl
    with open(tmp_path / ".orch" / "lock", "w") as fh:
        fh.write("R7")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_EX)
        out = subprocess.run([sys.executable, "-S", "-c", supervisor.FACTS_PY], env=env, capture_output=True,
                             text=True, timeout=30).stdout
    assert out.splitlines()[1:] == ["live R7", supervisor.AGENT_THERE]


@pytest.mark.parametrize("reach_body, rc, status, words", [
    ("supervisor\t3.11\nto 198.18.149.11 ok\n", 0, "pass", "python3=3.11 (supervisor)"),
    ("supervisor\t3.6\nto 198.18.149.11 ok\n", 0, "fail", "python3 is 3.6; the run's supervisor needs >= 3.8"),
    ("orch:not-installed\n", 0, "fail", "no python3 on the non-interactive ssh PATH"),
    ("python3: error while loading shared libraries\n", 127, "fail", "no python3 on the non-interactive ssh PATH"),
    ("orch: not run: mktemp could not create a temporary file on this host", 125, "pass", None),
])
def test_check_path_judges_the_supervisors_python3_from_the_reach_test(reach_body, rc, status, words):
    """Its path section without the version line, a host is judged on what its reach test's python3
    said; as python_sh's own fallback, a python3 that did not run is none. A reach section that did
    not run says nothing of python3 (the reach check reports that)."""
    c = cluster(n=3)
    p = checks.make_check_plan(c)
    path = "PATH=/usr/bin:/bin\nJOBPATH=/usr/bin:/bin\njob\tpython3\t/usr/bin/python3\n"
    run = checks.base.ProbeRun(c.hosts[1], {"path": Section("path", path, 0), "reach": Section("reach", reach_body, rc)})
    got = next(r for r in checks.judge_host(p, run) if r.check == "path")
    assert got.status == status, got
    if words:
        assert words in got.message, got
    else:
        assert "supervisor" not in got.message, got
    # path's own line, when its section has one, is the one judged
    own = Section("path", path.replace("JOBPATH", "supervisor\t3.12\nJOBPATH"), 0)
    run = replace(run, sections={**run.sections, "path": own})
    assert "python3=3.12 (supervisor)" in next(r for r in checks.judge_host(p, run) if r.check == "path").message


# --------------------------------------------------------------------------- parsers


def test_parse_listen():
    got = probes.parse_listen(fx("listen-h1.txt").body)
    assert got == Listen(43179, (LAUNCH, "198.18.149.200"), None)
    got = probes.parse_listen(fx("listen-interface-h1.txt").body)
    assert got.port == 54405 and got.interface == probes.IfAddr("eth0", LAUNCH, 24)
    got = probes.parse_listen("addr 10.0.0.1\nnolisten python3: not found")
    assert got.port is None and got.error == "python3: not found" and got.addresses == ("10.0.0.1",)
    for bad in ("", "listen\n", "listen 0\n", "listen 70000\n", "listen Traceback\n"):
        with pytest.raises(ProbeError):
            probes.parse_listen(bad)


def test_parse_reach():
    assert probes.parse_reach(fx("to-blackhole-other-ok.txt").body).tried == (
        (LAUNCH, "invalid argument"), ("198.18.149.200", "ok"))
    assert probes.parse_reach(fx("to-timeout.txt").body).tried == ((LAUNCH, "timed out after 2s"),)
    assert probes.parse_reach(probes.NOT_INSTALLED) is None
    got = probes.parse_reach("untested warn not tested: late")
    assert (got.untested, got.status, got.tried) == ("not tested: late", "warn", ())
    assert probes.parse_reach("untested error not tested: x").status == "error"
    with pytest.raises(ProbeError, match="unexpected reach test output"):
        probes.parse_reach("Traceback (most recent call last):\n")


# --------------------------------------------------------------------------- judging captured output


def judge(c: Cluster, name: str, i: int = 2) -> checks.CheckResult:
    return reach.judge_reach(plan_of(c), c.hosts[i - 1], fx(name))


def test_reaches_the_address_the_run_uses():
    r = judge(cluster(), "to-both-ok.txt")
    assert r.status == "pass"
    assert r.message == f"reaches the launch host rchx1-h1 by TCP at {LAUNCH} (its cluster address)"


def test_another_address_does_when_nothing_is_pinned_and_a_warning_says_which():
    r = judge(cluster(), "to-blackhole-other-ok.txt")
    assert r.status == "warn"
    assert r.message.startswith(f"reaches the launch host rchx1-h1 by TCP at 198.18.149.200, not at {LAUNCH} "
                                "(its cluster address: invalid argument)")
    assert "hostfiles and rank tables still name 198.18.149.11" in r.message
    assert "`mpi_address: 198.18.149.200` on rchx1-h1 makes them all use it" in r.message


@pytest.mark.parametrize("hosts, job, where", [
    ([host(1, mpi_address=LAUNCH), host(2), host(3)], {}, "its mpi_address"),
    (None, {"interface": "eth0"}, "its address on job.interface"),
])
def test_pinned_fails_and_names_the_address_that_works(hosts, job, where):
    r = judge(cluster(hosts, **job), "to-blackhole-other-ok.txt")
    assert r.status == "fail"
    assert r.message.startswith(f"cannot reach the launch host rchx1-h1 by TCP at {LAUNCH} ({where}): "
                                "invalid argument;")
    assert "it does reach rchx1-h1 at 198.18.149.200: set `mpi_address: 198.18.149.200` on rchx1-h1" in r.message


@pytest.mark.parametrize("name, why", [("to-unreachable.txt", "no route to host"),
                                       ("to-prohibit.txt", "permission denied"),
                                       ("to-timeout.txt", "timed out after 2s")])
def test_nothing_reached_names_host_address_and_fix(name, why):
    r = judge(cluster(), name)
    assert r.status == "fail" and r.host == "rchx1-h2"
    assert r.message.startswith(f"cannot reach the launch host rchx1-h1 by TCP at {LAUNCH} (its cluster "
                                f"address): {why}; ")
    assert "`mpi_address: <an address of rchx1-h1 the hosts reach>` on rchx1-h1" in r.message
    assert "`job.interface: <rchx1-h1's NIC on the hosts' network>`" in r.message


def test_nothing_reached_lists_every_address_tried():
    sec = Section("reach", f"to {LAUNCH} timed out after 2s\nto 10.1.0.1 connection refused\n", 0)
    r = reach.judge_reach(plan_of(cluster()), cluster().hosts[1], sec)
    assert r.status == "fail" and "(tried too: 10.1.0.1: connection refused)" in r.message
    pinned = cluster([host(1, mpi_address=LAUNCH), host(2)])
    r = reach.judge_reach(plan_of(pinned), pinned.hosts[1], sec)
    assert r.status == "fail" and "nor at rchx1-h1's other addresses" in r.message


def test_not_tested_and_no_python():
    c = cluster()
    p = plan_of(c)
    r = reach.judge_reach(p, c.hosts[1], Section("reach", "untested warn not tested: late", 0))
    assert (r.status, r.message) == ("warn", "not tested: late")
    r = reach.judge_reach(p, c.hosts[1], Section("reach", probes.NOT_INSTALLED, 0))
    assert r.status == "error" and "no python3" in r.message


def test_the_launch_host_row():
    c = cluster()
    r = reach.judge_listen(plan_of(c), c.hosts[0], fx("listen-h1.txt"))
    assert (r.status, r.message) == ("pass", "opened the test's TCP listener for the other 2 host(s)")
    r = reach.judge_listen(plan_of(c), c.hosts[0], Section("reach", "nolisten python3: not found", 1))
    assert r.status == "error" and "could not open the test's listener: python3: not found" in r.message


def test_applies_with_two_hosts_or_more_and_can_be_skipped():
    assert reach.Relay.of(checks.make_check_plan(cluster(n=1))) is None
    assert reach.Relay.of(checks.make_check_plan(cluster(skip=("reach",)))) is None
    assert reach.Relay.of(checks.make_check_plan(cluster())) is not None
    assert "_b reach" not in checks.probe_script(checks.make_check_plan(cluster(n=1)), host(1))


# --------------------------------------------------------------------------- the relay


def test_relay_from_the_listen_section_to_the_others_plans():
    c = cluster(n=3)
    p = checks.make_check_plan(c)
    relay = reach.Relay(p, 5)
    text = probes.join_sections([probes.Section("clock0", "1.0", 0)]) + (FIX / "listen-h1.txt").read_text()
    assert relay.feed(text[:-len("@@orch:end reach 0\n")]) is False and not relay.ready.is_set()
    assert relay.feed(text) is True
    got = relay.plan_for(c.hosts[1]).reach
    assert (got.port, got.addresses) == (43179, (LAUNCH, "198.18.149.200"))  # the run's address first
    relay.done("too late")  # resolved once
    assert relay.plan_for(c.hosts[2]).reach.port == 43179
    script = checks.probe_script(relay.plan_for(c.hosts[1]), c.hosts[1])
    assert f"' 1 43179 2 {LAUNCH} 198.18.149.200 2>&1" in script and p.reach_token[:32] in script
    assert p.reach_token not in script.replace(p.reach_token[:32], "", 1)  # each half alone, never on a command line
    clone = reach.Relay(p, 5)
    clone.decode(relay.encode())
    assert clone.target == relay.target
    broken = reach.Relay(p, 5)
    broken.decode(b"")
    assert "did not get the launch host's listener" in broken.target.untested


def test_relay_pinned_first_even_when_the_launch_host_lists_it_later():
    c = cluster([host(1, mpi_address="10.7.0.1"), host(2)])
    t = reach.target_for(checks.make_check_plan(c), probes.parse_listen(fx("listen-h1.txt").body), 0.0)
    assert t.addresses == ("10.7.0.1", LAUNCH, "198.18.149.200")
    c = cluster(interface="eth0")
    t = reach.target_for(checks.make_check_plan(c), probes.parse_listen(fx("listen-interface-h1.txt").body), 0.0)
    assert t.addresses == (LAUNCH, "198.18.149.200")


def test_relay_without_a_listener_late_or_never():
    c = cluster()
    p = checks.make_check_plan(c)
    relay = reach.Relay(p, 0.2)
    got = relay.plan_for(c.hosts[1]).reach   # gave up after its own 0.2 s, as the message says
    assert got.port == 0 and "listener was not up within 0.2s" in got.untested
    relay.resolve(ReachTarget(4000, (LAUNCH,), until=time.monotonic() - 1))
    got = relay.plan_for(c.hosts[1]).reach
    assert got.status == "warn" and "after the launch host's listener had closed" in got.untested
    script = checks.probe_script(relay.plan_for(c.hosts[1]), c.hosts[1])
    assert "echo 'untested warn not tested: this host" in script
    relay = reach.Relay(p, 5)
    relay.feed("@@orch:begin reach\nnolisten python3: not found\n\n@@orch:end reach 1\n")
    assert "could not open the test's listener: python3: not found" in relay.plan_for(c.hosts[1]).reach.untested


def test_listener_cap_grows_with_fanout_rounds_and_is_bounded():
    small = checks.make_check_plan(cluster(n=3))
    assert reach.reach_cap(small) == 2 * 2 + 2 * 2 + 2 * 2 + 10
    many = replace(cluster(n=3), hosts=tuple(host(i) for i in range(1, 201)))
    assert reach.reach_cap(checks.make_check_plan(many)) == 22 + 10 * 3  # 199 others, fan-out 64: 4 rounds
    huge = replace(many, hosts=tuple(Host(name=f"n{i}", address=f"10.{i // 250}.{i % 250}.1", user="u")
                                     for i in range(5000)))
    assert reach.reach_cap(checks.make_check_plan(huge)) == reach.MAX_CAP


# --------------------------------------------------------------------------- for real, on loopback


def sh(script: str, timeout: float = 30) -> str:
    return subprocess.run(["sh", "-c", "T=\n" + script], capture_output=True, text=True, timeout=timeout).stdout


def without_version(out: str) -> str:
    """A host's test output without the sections it gives the sh (GIVEN_PY: taken out as the probe's
    output is split) and its first line, the supervisor's python3 version for check path
    (supervisor.python_sh's line: the test's python3 is the supervisor's)."""
    sections = probes.split_sections(f"{probes.MARK}begin reach\n{out}\n{probes.MARK}end reach 0\n")
    first, _, rest = sections["reach"].body.partition("\n")
    assert re.fullmatch(r"supervisor\t3\.\d+", first), out
    return rest


def gone(port: int, within: float) -> bool:
    """The listener on `port` has closed within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return True
        time.sleep(0.1)
    return False


def start_listener(n: int = 1, cap: float = 20, grace: float = 0.3, peer: float = 0.5, token="a" * 64) -> int:
    env = {**os.environ, reach.ENV_IN: token[:32], reach.ENV_OUT: token[32:]}
    out = subprocess.run(["python3", "-S", "-c", reach.LISTEN_PY, str(n), str(cap), str(grace), str(peer),
                          str(reach.READ_LIMIT), "127.0.0.1"], input="", env=env, capture_output=True, text=True,
                         timeout=10)
    assert out.returncode == 0, out.stderr  # the listener has detached: its first process is gone
    return int(out.stdout)


def hello(port: int, line: bytes, timeout: float = 3) -> bytes:
    """What the listener answers `line` (b"": nothing, it closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        data = b""
        try:
            s.sendall(line)
            while len(data) < 1024:
                chunk = s.recv(1024)
                if not chunk:
                    break
                data += chunk
        except ConnectionResetError:  # it closed with our bytes unread (READ_LIMIT): TCP resets
            pass
        return data


def test_the_launch_host_section_and_a_hosts_test_for_real():
    """The launch host's section (every line of it) opens a listener that detaches; a host's test
    reaches it at 127.0.0.1 and says why not elsewhere; the listener is gone once both hosts
    came (and GRACE). Loopback only."""
    c = cluster([host(1, connection="local", address="127.0.0.1"), host(2, connection="local", address="127.0.0.2"),
                 host(3, connection="local", address="127.0.0.3")])
    p = checks.make_check_plan(c)
    assert reach.reach_cap(p) > 10   # a section that waited for its listener would outlive sh's time-out
    listen = probes.parse_listen(sh(reach.listen_body(p), timeout=10))
    assert listen.port
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on (bound, not listening: refused)
    assert reach.target_for(p, listen, 0.0).addresses == ("127.0.0.1",)  # every host is this machine
    target = ReachTarget(listen.port, ("127.0.0.1",), 0.0)
    bad = without_version(sh(reach.connect_body(replace(p, reach=target, reach_token="b" * 64), c.hosts[1])))
    assert bad == "to 127.0.0.1 connected, but closed without an answer\n"  # the wrong token
    assert not gone(listen.port, 0.2)  # ... is no host: the listener still waits
    dead = ReachTarget(closed.getsockname()[1], ("127.0.0.1",), 0.0)
    assert without_version(sh(reach.connect_body(replace(p, reach=dead), c.hosts[1]))) == "to 127.0.0.1 connection refused\n"
    for h in c.hosts[1:]:
        assert without_version(sh(reach.connect_body(replace(p, reach=ReachTarget(listen.port, ("127.0.0.1",), 0.0)), h))) == \
            "to 127.0.0.1 ok\n"
    assert gone(listen.port, reach.GRACE + 2)
    closed.close()


def test_the_listener_answers_only_the_token_reads_bounded_bytes_and_waits_boundedly():
    slow = start_listener(n=1, peer=60)
    assert hello(slow, b"x" * 100_000, timeout=10) == b""        # garbage: READ_LIMIT bytes read, no answer, and
    hello(slow, b"a" * 32 + b" 1\n")                             # ... dropped at once, not after the 60 s wait
    port = start_listener(n=1, peer=1.5)
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)  # sends nothing: dropped after 1.5 s,
    assert silent.recv(10) == b""                                       # not left open (the 10 s would raise)
    assert hello(port, b"a" * 32 + b"\n") == b""                 # the token without a host: no answer
    assert hello(port, b"b" * 32 + b" 1\n") == b""               # the answer's half is not the question's
    assert not gone(port, 0.2)
    assert hello(port, b"a" * 32 + b" 1\n") == b"a" * 32 + b"\n"  # (start_listener's token: "a" * 64)
    assert gone(port, 3)
    silent.close()


def test_the_listener_goes_at_its_cap_when_a_host_never_comes():
    port = start_listener(n=2, cap=1.0)
    assert hello(port, b"a" * 32 + b" 1\n") == b"a" * 32 + b"\n"
    assert gone(port, 4)   # its cap (1 s), not the host that never comes


def test_the_launch_host_lists_its_global_ipv4_addresses_with_or_without_ip(tmp_path):
    """ADDRS_SH (no traffic: it reads this machine's own addresses): `ip`'s global IPv4 addresses in
    its order; without `ip`, the same ones from /proc/net/fib_trie."""
    want = [ln.split()[3].split("/")[0] for ln in subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout.splitlines()]
    got = probes.parse_listen(sh(reach.ADDRS_SH) + "listen 1\n").addresses
    assert list(got) == list(dict.fromkeys(want))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("awk", "sh"):
        (bin_ / tool).symlink_to(subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                                                text=True).stdout.strip())
    out = subprocess.run([str(bin_ / "sh"), "-c", reach.ADDRS_SH], capture_output=True, text=True,
                         env={"PATH": str(bin_)}).stdout
    assert sorted(probes.parse_listen(out + "listen 1\n").addresses) == sorted(set(want))


def test_no_python_on_the_launch_host():
    c = cluster()
    p = checks.make_check_plan(c)
    body = reach.listen_body(p).replace("python3 -S -c", "/nonexistent/python3 -S -c")
    got = probes.parse_listen(sh(body))
    assert got.port is None and "not found" in got.error


# --------------------------------------------------------------------------- run_checks: the others wait


class Canned(Transport):
    """Answers each probe with `output(script)`, after `delay`; keeps the scripts."""

    def __init__(self, h: Host, output, delay: float = 0.0, connect_error=None):
        super().__init__(h, 30)
        self.output, self.delay, self.connect_error = output, delay, connect_error
        self.scripts: list[str] = []
        self.sent_at: float | None = None

    def connect(self):
        if self.connect_error:
            raise self.connect_error

    def _exec(self, script, *, stdin, sink, timeout):
        self.scripts.append(stdin.decode() if stdin else script)
        self.sent_at = time.monotonic()
        time.sleep(self.delay)
        out = self.output(self.scripts[-1]).encode()
        if sink is not None:
            sink.write(out)
            return 0, b"", b""
        return 0, out, b""


def run_reach_section(script: str) -> str:
    """A host's probe, as far as its reach section goes (run for real when it only says why it
    does not test: an echo)."""
    (line,) = [ln for ln in script.splitlines() if ln.startswith("echo 'untested ")]
    return f"@@orch:begin reach\n{sh(line)}\n@@orch:end reach 0\n"


class Pool:
    def __init__(self, ts):
        self.t = {t.host.name: t for t in ts}

    def __getitem__(self, h):
        return self.t[h.name if isinstance(h, Host) else h]


def test_run_checks_sends_the_others_probes_with_the_listener():
    c = cluster(n=3, skip=("mesh",))
    listen = (FIX / "listen-h1.txt").read_text()
    ok = (FIX / "to-both-ok.txt").read_text()
    ts = [Canned(c.hosts[0], lambda s: listen, delay=0.3)] + [Canned(h, lambda s: ok) for h in c.hosts[1:]]
    rep = checks.run_checks(c, Pool(ts))
    for i, t in enumerate(ts[1:], 1):   # sent with the listener's port and addresses, after it was up
        assert f"' {i} 43179 2 198.18.149.11 198.18.149.200 2>&1" in t.scripts[0]
        assert t.sent_at >= ts[0].sent_at
    got = {r.host: r for r in rep.results if r.check == "reach"}
    assert [got[h.name].status for h in c.hosts] == ["pass"] * 3


def test_run_checks_when_the_launch_host_gives_no_listener():
    from orchestrator.errors import AuthError

    c = cluster(n=3, skip=("mesh",))
    ts = [Canned(c.hosts[0], lambda s: "", connect_error=AuthError(c.hosts[0].name, "key refused"))]
    ts += [Canned(h, run_reach_section) for h in c.hosts[1:]]
    rep = checks.run_checks(c, Pool(ts))   # no wait for a listener that cannot come: the message says why
    got = {r.host: r for r in rep.results if r.check == "reach"}
    assert got["rchx1-h1"].status == "error"
    for h in ("rchx1-h2", "rchx1-h3"):
        assert got[h].status == "error"
        assert got[h].message == "not tested: the launch host rchx1-h1's probe did not run: rchx1-h1: key refused"


def test_forked_fan_out_processes_get_the_listener():
    """shards: `late`'s value reaches every child (while its hosts already run), through the gate's pipe."""
    me = os.getpid()
    hosts = [Host(name=f"h{i}", address=f"10.9.0.{i}", user="u") for i in range(6)]
    value = threading.Event()
    box: dict = {}

    def late() -> bytes:
        time.sleep(0.3)
        return b"port 4242"

    def child_late(data: bytes) -> None:
        box["late"] = data
        value.set()

    def child(h):
        assert value.wait(5)
        return [os.getpid(), box["late"].decode()]

    res = shards.fan_out_procs(hosts, lambda h: [os.getpid(), "parent"], procs=2, encode=lambda v: v,
                               decode=lambda h, v: v, limit=6, timeout=20, keep={"h0"}, child_fn=child,
                               late=late, child_late=child_late)
    forked = [o.value for o in res.values() if o.value[0] != me]
    assert forked and all(v[1] == "port 4242" for v in forked)



def test_the_listener_binds_only_the_addresses_the_hosts_test_never_the_wildcard():
    """The run's address (argv) and the host's addresses (ADDRS_SH's lines on stdin): listened on;
    any other address of the host: refused (nothing on 0.0.0.0). Nothing bindable: it says so."""
    env = {**os.environ, reach.ENV_IN: "a" * 32, reach.ENV_OUT: "b" * 32}
    argv = ["python3", "-S", "-c", reach.LISTEN_PY, "1", "5", "0.3", "1", str(reach.READ_LIMIT)]
    out = subprocess.run([*argv, "127.0.0.1"], input="addr 127.0.0.2\nother line\n", env=env, capture_output=True,
                         text=True, timeout=10)
    port = int(out.stdout)
    for addr, ok in (("127.0.0.1", True), ("127.0.0.2", True), ("127.0.0.3", False)):
        try:
            socket.create_connection((addr, port), timeout=3).close()
            reached = True
        except ConnectionRefusedError:
            reached = False
        assert reached == ok, addr
    assert hello(port, b"a" * 32 + b" 1\n") == b"b" * 32 + b"\n"   # and it ends (n=1)
    bad = subprocess.run([*argv, "192.0.2.254"], input="", env=env, capture_output=True, text=True, timeout=10)
    assert bad.returncode != 0 and "cannot listen on 192.0.2.254" in bad.stderr


# Runs a program as `python3 -S -c PROG ARGS` would, with the costly modules made unimportable and
# getaddrinfo counted: `import socket`/`threading` (~8 ms of every host's start) and glibc's
# getaddrinfo (~8 ms more) are what the test on every host must do without.
_LEAN = ("import sys,_socket\n"
         "class _No:\n"
         " def find_spec(self,name,path=None,target=None):\n"
         "  if name in ('socket','threading','selectors'):raise ImportError('lean: '+name)\n"
         "sys.meta_path.insert(0,_No())\n"
         "_g=_socket.getaddrinfo\n"
         "def _count(*a,**k):\n"
         " sys.stderr.write('getaddrinfo %s\\n'%(a[0],));return _g(*a,**k)\n"
         "_socket.getaddrinfo=_count\n"
         "_p,sys.argv=sys.argv[1],['-c']+sys.argv[2:]\n"
         "exec(compile(_p,'<prog>','exec'),{'__name__':'__main__'})\n")


def lean(prog: str, *args: str, env: dict, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(["python3", "-S", "-c", _LEAN, prog, *args], input=stdin, env=env, capture_output=True,
                          text=True, timeout=20)


def test_the_listener_and_the_test_start_lean_and_look_up_only_names():
    """Neither program imports socket or threading, nor asks getaddrinfo about an IP address (a
    name is still looked up): each would cost every host ~8 ms of CPU more."""
    env = {**os.environ, reach.ENV_IN: "a" * 32, reach.ENV_OUT: "b" * 32}
    out = lean(reach.LISTEN_PY, "1", "20", "0.3", "1", str(reach.READ_LIMIT), "127.0.0.1", env=env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    port = out.stdout.strip()
    got = lean(reach.CONNECT_PY, "1", port, "2", "127.0.0.1", "localhost", env=env)
    assert got.returncode == 0, got.stderr
    assert without_version(got.stdout).splitlines()[0] == "to 127.0.0.1 ok"
    assert got.stderr.splitlines() == ["getaddrinfo localhost"]   # the name only
    assert gone(int(port), reach.GRACE + 3)


def test_in_up_each_other_ssh_host_holds_its_session_and_nothing_else_does():
    """reach.holds: `orch up` (a run id, not Slurm), the hosts whose reach test runs (not the
    launch host), over SSH; the probe's frame (probes.assemble's hold) exactly there."""
    c = cluster(n=3)
    target = ReachTarget(43121, (LAUNCH,), 0.0)
    up = replace(checks.make_check_plan(c, prepare=True, run_id="R1"), reach=target)
    assert [reach.holds(up, h) for h in up.hosts] == [False, True, True]
    assert ["exec 3<&0" in runner.probe_script(up, h) for h in up.hosts] == [False, True, True]
    assert not any(reach.holds(p, h) for p in (
        replace(checks.make_check_plan(c, prepare=True), reach=target),      # no run id: prepare's own round trip
        replace(checks.make_check_plan(c), reach=target),                    # orch check
        replace(up, reach=None)) for h in up.hosts)                          # no listener to test
    local = cluster(hosts=[host(i, connection="local") for i in (1, 2)])
    lp = replace(checks.make_check_plan(local, prepare=True, run_id="R1"), reach=target)
    assert not any(reach.holds(lp, h) for h in lp.hosts)
