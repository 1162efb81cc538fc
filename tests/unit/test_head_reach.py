"""Where the other hosts reach the launch host (launchers.head_reach), and the controller's side of
the contract with the hosts' supervisors: each configuration's `head_addresses` / `head_pinned`,
the head's `ok PID PORT ADDR,...`, the members started with the head's own list, and
launchers.HEAD_ADDR in commands wherever the address is not pinned."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import launchers, lifecycle, supervisor
from orchestrator.errors import HostError, SessionRefused
from orchestrator.fanout import Outcome, Results
from orchestrator.launchers import HEAD_ADDR, head_reach
from orchestrator.rankplan import make_plan
from orchestrator.runs import create_run
from orchestrator.spec import Cluster, Host, Job
from orchestrator.transport.base import Transport
from tests.support import wait_until


def hosts(n=2, mpi: bool = False, **first) -> tuple[Host, ...]:
    """h1..hn at 10.0.0.i (with `mpi`, each with mpi_address 192.168.0.i: h1 stays the launch host)."""
    hs = [Host(name=f"h{i}", address=f"10.0.0.{i}", user="root", slots=2, devices=(0, 1),
               mpi_address=f"192.168.0.{i}" if mpi else None) for i in range(1, n + 1)]
    hs[0] = replace(hs[0], **first)
    return tuple(hs)


def cluster(hs=None, launcher="torchrun", tmp: Path | None = None, **job) -> Cluster:
    return Cluster(name="t", path=(tmp or Path("/nonexistent")) / "cluster.yaml", hosts=hs or hosts(),
                   job=Job(workdir="/data/job", command=("python3", "t.py"), launcher=launcher, **job))


@pytest.mark.parametrize("kw, job, n, want", [
    ({}, {}, 2, (("10.0.0.1",), False, "cluster")),
    ({"hostname": "10.1.0.1"}, {}, 2, (("10.1.0.1",), False, "cluster")),            # ssh_config's HostName
    ({"mpi_address": "192.168.0.1"}, {}, 2, (("192.168.0.1",), True, "mpi_address")),
    ({"mpi_address": "192.168.0.1"}, {"interface": "eth1"}, 2, (("192.168.0.1",), True, "mpi_address")),
    ({}, {"interface": "eth1"}, 2, (("<h1's address on job.interface eth1>",), True, "interface")),
    ({}, {}, 1, (("10.0.0.1",), True, "single")),
])
def test_head_reach_rules(kw, job, n, want):
    c = cluster(hosts(n, **kw), **job)
    got = head_reach(c, c.hosts[0], c.hosts)
    assert (got.addresses, got.pinned, got.why) == want
    assert got.rendered == (want[0][0] if want[1] else HEAD_ADDR)


def test_head_reach_interface_address_and_this_machine():
    c = cluster(interface="eth1")
    assert head_reach(c, c.hosts[0], c.hosts, "192.168.9.1").addresses == ("192.168.9.1",)
    local = tuple(replace(h, connection="local", address=f"127.0.0.{i}") for i, h in enumerate(hosts(), 1))
    got = head_reach(cluster(local), local[0], local)
    assert (got.addresses, got.pinned) == (("127.0.0.1",), True)
    # this machine launches, the others are remote: they try its cluster address (never 127.0.0.1)
    mixed = (replace(hosts()[0], connection="local"), hosts()[1])
    got = head_reach(cluster(mixed), mixed[0], mixed)
    assert (got.addresses, got.pinned) == (("10.0.0.1",), False)


@pytest.mark.parametrize("launcher", ["torchrun", "msrun", "ranktable"])
def test_the_master_address_is_the_token_unless_pinned(launcher):
    def master(c, iface=None) -> set[str]:
        launch = launchers.build(c, make_plan(c), "R", root={}, head_interface_address=iface)
        got = set()
        for procs in launch.procs.values():
            for p in procs:
                got |= {a.split("=", 1)[1] for a in p.argv if a.startswith(("--master_addr=", "--master-addr="))}
                if "MASTER_ADDR" in p.env:
                    got.add(p.env["MASTER_ADDR"])
        return got

    assert master(cluster(launcher=launcher)) == {HEAD_ADDR}
    assert master(cluster(hosts(mpi=True), launcher=launcher)) == {"192.168.0.1"}
    assert master(cluster(launcher=launcher, interface="eth1"), "192.168.9.1") == {"192.168.9.1"}
    assert master(cluster(hosts(1), launcher=launcher)) == {"10.0.0.1"}  # one host: nothing to choose
    c = cluster(launcher=launcher, env={"MASTER_ADDR": "mine"})
    if launcher == "ranktable":  # the user's own value wins, as before
        assert master(c) == {"mine"}


def test_configs_carry_the_head_addresses():
    c = cluster()
    plan = make_plan(c)
    cfgs = supervisor.configs(c, plan, "R", launchers.build(c, plan, "R", root={}))
    for cfg in cfgs.values():
        assert cfg["head_addresses"] == ["10.0.0.1"] and cfg["head_pinned"] is False
        assert cfg["head_address"] == "10.0.0.1"  # what agent.py reads until it takes the list
    c = cluster(interface="eth1")
    plan = make_plan(c)
    launch = launchers.build(c, plan, "R", root={}, head_interface_address="192.168.9.1")
    cfg = supervisor.configs(c, plan, "R", launch)["h2"]
    assert cfg["head_addresses"] == ["192.168.9.1"] and cfg["head_pinned"] is True


@pytest.mark.parametrize("text, want", [
    ("ok 123 4567\n", ("ok", 123, 4567, ())),
    ("ok 123 4567 10.0.0.1\n", ("ok", 123, 4567, ("10.0.0.1",))),
    ("noise\nok 123 4567 10.0.0.1,192.168.0.1,fd00::1\n", ("ok", 123, 4567, ("10.0.0.1", "192.168.0.1", "fd00::1"))),
    ("busy 20260101-000000-abcdef\n", ("busy:20260101-000000-abcdef", 0, 0, ())),
    ("ok 123\n", ("error", 0, 0, ())),
    ("ok x 4567 10.0.0.1\n", ("error", 0, 0, ())),
    ("ok 1 2 a b\n", ("error", 0, 0, ())),
    ("Traceback (most recent call last):\n", ("error", 0, 0, ())),
])
def test_parse_start(text, want):
    assert supervisor.parse_start(text) == want


class StartHost(Transport):
    """Answers a supervisor's start (supervisor.Boot) with `answer`; keeps the configuration it was
    given (a member's: as its host reads it, the head's line, if one came, merged in) and what its
    stdin gave at once (`first`, set by then: `booted`). No configuration (the head's is sent once
    the code is synced), or a member's without the head's line: "nohead", as the agent says."""

    def __init__(self, h: Host, answer: str):
        super().__init__(h, 30)
        self.answer, self.cfgs, self.first = answer, [], b""
        self.booted, self.told = threading.Event(), threading.Event()

    def _exec(self, script, *, stdin, sink, timeout):
        self.first = stdin.read(-1)
        self.booted.set()
        lines = (self.first + b"".join(iter(lambda: stdin.read(1 << 16), b""))).decode().split("\n")
        self.told.set()
        if not lines[1]:
            return 0, b"nohead\n", b""
        cfg = json.loads(lines[1])
        cfg.update(json.loads(lines[2]) if lines[2] else {})
        self.cfgs.append(cfg)
        return 0, (self.answer if lines[2] or cfg["role"] == "head" else "nohead\n").encode(), b""


class Pool:
    def __init__(self, ts):
        self.t = {t.host.name: t for t in ts}

    def __getitem__(self, h):
        return self.t[h.name if isinstance(h, Host) else h]


@pytest.mark.parametrize("head_says, members_get", [
    ("ok 11 4242 10.0.0.1,192.168.0.1\n", ["10.0.0.1", "192.168.0.1"]),
    ("ok 11 4242\n", ["10.0.0.1"]),  # a head that names none: the members keep their own
])
def test_members_start_with_the_heads_addresses(tmp_path, head_says, members_get):
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [StartHost(plan.hosts[0], head_says)] + [StartHost(h, "ok 12 0\n") for h in plan.hosts[1:]]
    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts))
    lc.start(launchers.build(c, plan, run.id, root={}))
    assert ts[0].cfgs[0]["role"] == "head" and ts[0].cfgs[0]["head_addresses"] == ["10.0.0.1"]
    for t in ts[1:]:
        (cfg,) = t.cfgs
        assert cfg["role"] == "member" and cfg["head_port"] == 4242
        assert cfg["head_addresses"] == members_get and cfg["head_address"] == members_get[0]
        assert cfg["head_pinned"] is False
    assert json.loads((run.dir / "run.json").read_text())["head_addresses"] == members_get


def test_members_start_beside_the_head_and_a_head_that_does_not_start_starts_none(tmp_path):
    """The members' starts go out with the head's (each waits on its stdin for the head's port);
    when the head says another run holds the workdir, their stdin ends without it: the head's
    conflict is what is said, and no member was told a port."""
    from orchestrator.errors import RunConflict

    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [StartHost(plan.hosts[0], "busy 20260101-000000-abcdef\n")] + [StartHost(h, "ok 12 0\n") for h in plan.hosts[1:]]
    with pytest.raises(RunConflict, match="run 20260101-000000-abcdef is still running"):
        lifecycle.Lifecycle(c, plan, run, Pool(ts)).start(launchers.build(c, plan, run.id, root={}))
    for t in ts[1:]:
        (cfg,) = t.cfgs
        assert cfg["role"] == "member" and cfg["head_port"] is None


def test_every_start_goes_out_while_the_code_syncs_and_the_head_gets_its_configuration_after(tmp_path):
    """lifecycle.start(sync=...): every host's python3 has its package's line (a member's, its
    configuration too) while the sync runs; the head's configuration goes only once the sync has
    returned, then the members get the head's port."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [StartHost(plan.hosts[0], "ok 11 4242 10.0.0.1\n")] + [StartHost(h, "ok 12 0\n") for h in plan.hosts[1:]]
    during: dict[str, bytes] = {}

    def sync():
        for t in ts:
            assert t.booted.wait(10), t.host.name
        during.update({t.host.name: t.first for t in ts})
        assert not ts[0].told.wait(0.2)   # the head's stdin, had its configuration come, would have ended

    lifecycle.Lifecycle(c, plan, run, Pool(ts)).start(launchers.build(c, plan, run.id, root={}), sync=sync)
    head, *members = ts
    assert during[head.host.name] == supervisor.agent_blob().encode() + b"\n"   # the package alone
    for t in members:
        package, conf, rest = during[t.host.name].split(b"\n")
        assert package == supervisor.agent_blob().encode() and json.loads(conf)["role"] == "member" and rest == b""
        assert t.cfgs[0]["head_port"] == 4242
    assert head.cfgs[0]["role"] == "head"


def test_a_sync_that_fails_starts_nothing_anywhere(tmp_path):
    """The sync raising while the starts wait: its error is what is said; the head never gets its
    configuration, no member the head's port; every start has ended by then (said nohead)."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [StartHost(plan.hosts[0], "ok 11 4242\n")] + [StartHost(h, "ok 12 0\n") for h in plan.hosts[1:]]

    def sync():
        for t in ts:
            assert t.booted.wait(10)
        raise lifecycle.LaunchError("distribution failed; nothing was started")

    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts))
    before = set(threading.enumerate())
    with pytest.raises(lifecycle.LaunchError, match="distribution failed"):
        lc.start(launchers.build(c, plan, run.id, root={}), sync=sync)
    assert not lc.started and ts[0].cfgs == []
    assert [cfg["head_port"] for t in ts[1:] for cfg in t.cfgs] == [None, None]
    assert not [t for t in set(threading.enumerate()) - before if t.name == "orch-meanwhile"]   # every start ended


class Said(lifecycle.Events):
    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, message: str) -> None:
        self.warnings.append(message)


class OneSession(StartHost):
    """A host whose sshd takes one session at a time: its first `refuse` starts are refused (the
    sync has the session); `inflight`: its starts not ended."""

    def __init__(self, h: Host, answer: str, refuse: int = 0):
        super().__init__(h, answer)
        self.refuse, self.refused, self.inflight, self.ran = refuse, 0, 0, 0

    def _exec(self, script, *, stdin, sink, timeout):
        if self.refuse:
            self.refuse -= 1
            self.refused += 1
            raise SessionRefused(self.host.name, "its SSH server refused one more session")
        self.inflight += 1
        self.ran += 1
        try:
            return super()._exec(script, stdin=stdin, sink=sink, timeout=timeout)
        finally:
            self.inflight -= 1


def test_a_sync_refused_a_session_runs_alone_then_the_starts(tmp_path):
    """sshd's MaxSessions 1 on the launch host, its start there first: the sync's session is
    refused. Every start ends, told nothing; the sync runs again with no start out, then the
    starts; the user is told why."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [OneSession(plan.hosts[0], "ok 11 4242\n")] + [OneSession(h, "ok 12 0\n") for h in plan.hosts[1:]]
    syncs: list[int] = []

    def sync():
        if not syncs:
            assert all(t.booted.wait(10) for t in ts)
            syncs.append(sum(t.inflight for t in ts))
            # as distribute says it: each host's error (the launch host's relay refused, the others not synced)
            Results({ts[0].host.name: Outcome(ts[0].host, error=SessionRefused(ts[0].host.name, "refused")),
                     **{t.host.name: Outcome(t.host, error=HostError(t.host.name, "not synced")) for t in ts[1:]}}
                    ).raise_if_failed(lifecycle.LaunchError, "distribution failed; nothing was started")
        syncs.append(sum(t.inflight for t in ts))

    said = Said()
    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts), said)
    lc.start(launchers.build(c, plan, run.id, root={}), sync=sync)
    assert syncs == [3, 0] and lc.started   # the second sync alone
    assert [cfg["role"] for cfg in ts[0].cfgs] == ["head"]
    assert [[cfg["head_port"] for cfg in t.cfgs] for t in ts[1:]] == [[None, 4242]] * 2
    (warning,) = said.warnings
    assert warning.startswith(f"{ts[0].host.name}: the SSH server takes one session at a time there") and \
        "MaxSessions 1" in warning


def test_a_sync_that_fails_otherwise_is_not_tried_again(tmp_path):
    """Only a sync refused a session is run again alone: one that failed for another reason is
    said as it is, once, with no warning about sessions."""
    c = cluster(hosts(2), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [OneSession(plan.hosts[0], "ok 11 4242\n"), OneSession(plan.hosts[1], "ok 12 0\n")]
    syncs: list[int] = []

    def sync():
        syncs.append(1)
        Results({t.host.name: Outcome(t.host, error=HostError(t.host.name, "no space left")) for t in ts}
                ).raise_if_failed(lifecycle.LaunchError, "distribution failed; nothing was started")

    said = Said()
    with pytest.raises(lifecycle.LaunchError, match="no space left"):
        lifecycle.Lifecycle(c, plan, run, Pool(ts), said).start(launchers.build(c, plan, run.id, root={}), sync=sync)
    assert syncs == [1] and said.warnings == []


def test_a_start_refused_a_session_waits_for_the_syncs_end(tmp_path):
    """sshd's MaxSessions 1, the sync's session there first: the start refused there waits for
    the sync's end and starts then; the sync runs once, nothing is said."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [OneSession(plan.hosts[0], "ok 11 4242\n", refuse=1)] + [OneSession(h, "ok 12 0\n", refuse=1)
                                                                   for h in plan.hosts[1:]]
    syncs: list[int] = []

    def sync():
        assert wait_until(lambda: all(t.refused for t in ts), 10)
        syncs.append(sum(t.inflight for t in ts))

    said = Said()
    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts), said)
    lc.start(launchers.build(c, plan, run.id, root={}), sync=sync)
    assert syncs == [0] and lc.started and said.warnings == []
    assert [cfg["head_port"] for t in ts[1:] for cfg in t.cfgs] == [4242, 4242]


def test_a_start_refused_while_the_sync_fails_asks_nothing_more(tmp_path):
    """A start refused a session waits for the sync's end; the sync failed: it does not ask again
    (a session only to be told nothing), and the sync's error is what is said."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [OneSession(h, "ok 11 4242\n", refuse=1) for h in plan.hosts]

    def sync():
        assert wait_until(lambda: all(t.refused for t in ts), 10)
        raise lifecycle.LaunchError("distribution failed; nothing was started")

    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts), Said())
    with pytest.raises(lifecycle.LaunchError, match="distribution failed"):
        lc.start(launchers.build(c, plan, run.id, root={}), sync=sync)
    assert [t.ran for t in ts] == [0, 0, 0] and not lc.started


def test_an_interrupt_once_the_head_runs_leaves_it_to_be_stopped(tmp_path, monkeypatch):
    """Ctrl-C after the head's supervisor started, before the members were told its port: the
    members start nothing, and the run counts as started, so that up stops the head."""
    c = cluster(hosts(3), tmp=tmp_path)
    plan = make_plan(c)
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    ts = [StartHost(plan.hosts[0], "ok 11 4242\n")] + [StartHost(h, "ok 12 0\n") for h in plan.hosts[1:]]

    def interrupted(port, addresses):
        raise KeyboardInterrupt

    monkeypatch.setattr(supervisor, "head_line", interrupted)
    lc = lifecycle.Lifecycle(c, plan, run, Pool(ts))
    with pytest.raises(KeyboardInterrupt):
        lc.start(launchers.build(c, plan, run.id, root={}))
    assert lc.started and [cfg["role"] for cfg in ts[0].cfgs] == ["head"]
    assert [cfg["head_port"] for t in ts[1:] for cfg in t.cfgs] == [None, None]


def test_a_hosts_stdin_waits_for_its_line_or_its_end():
    """lifecycle._Line: the first bytes at once, then the line once sent, then the end; closed
    unsent: the end."""
    told = lifecycle._Line()
    r = told.reader(b"pkg\ncfg\n")
    assert r.read(4) == b"pkg\n" and r.read(-1) == b"cfg\n"
    threading.Timer(0.05, told.send, [b'{"head_port": 1}\n']).start()
    assert r.read(1 << 16) == b'{"head_port": 1}\n' and r.read(1 << 16) == b""
    unsent = lifecycle._Line()
    r = unsent.reader(b"x\n")
    threading.Timer(0.05, unsent.close).start()
    assert r.read(1 << 16) == b"x\n" and r.read(1 << 16) == b"" and not unsent.sent
    # while it waits, a blank line every `keepalive` seconds (the host's start skips them)
    later = lifecycle._Line(keepalive=0.02)
    r = later.reader(b"")
    assert [r.read(1 << 16) for _ in range(3)] == [b"\n"] * 3   # nothing sent yet
    later.send(b"go\n")
    assert r.read(1 << 16) == b"go\n" and r.read(1 << 16) == b""


def test_plan_says_what_the_token_stands_for(tmp_path):
    from click.testing import CliRunner

    from orchestrator.cli import cli

    f = tmp_path / "cluster.yaml"
    f.write_text("inventory:\n  hosts: [{address: 10.0.0.1, name: a}, {address: 10.0.0.2, name: b}]\n"
                 "job: {workdir: /data/job, launcher: torchrun, command: python3 t.py}\n")
    res = CliRunner().invoke(cli, ["plan", str(f), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert (f"the other hosts reach a at the first of a's addresses they reach, its cluster address 10.0.0.1 "
            f"first (commands hold {HEAD_ADDR} for it)") in res.output
    doc = json.loads((tmp_path / "out" / "commands.json").read_text())
    assert doc["head_address"]["in_commands"] == HEAD_ADDR and doc["head_address"]["pinned"] is False
    assert f"--master-addr={HEAD_ADDR}" in doc["hosts"]["b"][0]["argv"]
    f.write_text(f.read_text().replace("name: a}", "name: a, mpi_address: 192.168.0.1}")
                 .replace("name: b}", "name: b, mpi_address: 192.168.0.2}"))
    res = CliRunner().invoke(cli, ["plan", str(f), "--out", str(tmp_path / "out")])
    assert "the other hosts reach a at 192.168.0.1 (its mpi_address)" in res.output
    doc = json.loads((tmp_path / "out" / "commands.json").read_text())
    assert "--master-addr=192.168.0.1" in doc["hosts"]["b"][0]["argv"]
