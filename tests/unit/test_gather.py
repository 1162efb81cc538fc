"""Log gathering in one round trip per host: runlogs.GATHER_PY (what runs on the host, here run
locally with python3 -S) and its stream's sink (runlogs._Gathered), end to end on files."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator import runlogs
from orchestrator.errors import OrchError


class FakeRun:
    """The part of runs.Run gathering uses: the id, the local copies, the run's directory here."""

    def __init__(self, here: Path):
        self.id = "RID"
        self.dir = here
        self.data: dict = {}

    def local_log(self, rank: int, attempt: int = 1) -> Path:
        base = self.dir / "logs" if attempt <= 1 else self.dir / "logs" / f"attempt-{attempt}"
        return base / f"rank.{rank}" / "stdout"


@pytest.fixture
def setup(tmp_path):
    workdir = tmp_path / "host" / "wd"
    rd = workdir / ".orch" / "RID"
    cluster = SimpleNamespace(job=SimpleNamespace(workdir=str(workdir)))
    run = FakeRun(tmp_path / "here")

    def remote(attempt: int, rank: int, data: bytes) -> Path:
        p = rd / f"a{attempt}" / "1" / f"rank.{rank}" / "stdout"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return p

    def gather(ranks, launcher: str | None = None, local_launcher: Path | None = None) -> bytes:
        argv = runlogs.gather_script(run, cluster, ranks, launcher)
        out = subprocess.run(argv, capture_output=True, check=True).stdout
        sink = runlogs._Gathered(run, local_launcher)
        for i in range(0, len(out), 7):  # as a transport delivers it: in pieces
            sink.write(out[i:i + 7])
        sink.close(True)
        return out

    return SimpleNamespace(run=run, rd=rd, remote=remote, gather=gather)


def test_every_attempt_of_the_hosts_ranks_and_only_new_bytes(setup):
    s = setup
    s.remote(1, 0, b"zero\n")
    s.remote(1, 1, b"one\n")
    s.remote(2, 1, b"one again\n")
    s.remote(1, 5, b"not this host's\n")
    s.gather([0, 1])
    assert s.run.local_log(0).read_bytes() == b"zero\n"
    assert s.run.local_log(1, 2).read_bytes() == b"one again\n"
    assert not s.run.local_log(5).exists()
    s.remote(1, 0, b"zero\nmore\n")
    out = s.gather([0, 1])
    assert s.run.local_log(0).read_bytes() == b"zero\nmore\n"
    assert out == b"D 1 0 5 5\nmore\n"  # only what is new moved


def test_a_log_rewritten_there_is_fetched_again_from_its_start(setup):
    s = setup
    s.remote(1, 0, b"a long first version\n")
    s.gather([0])
    s.remote(1, 0, b"short\n")
    s.gather([0])
    assert s.run.local_log(0).read_bytes() == b"short\n"


def test_bytes_another_command_copied_meanwhile_are_not_written_twice(setup):
    s = setup
    s.remote(1, 0, b"0123456789")
    argv = runlogs.gather_script(s.run, SimpleNamespace(job=SimpleNamespace(workdir=str(s.rd.parents[1]))), [0])
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    s.run.local_log(0).parent.mkdir(parents=True)
    s.run.local_log(0).write_bytes(b"0123")  # another `orch logs` got there first
    sink = runlogs._Gathered(s.run, None)
    sink.write(out)
    sink.close(True)
    assert s.run.local_log(0).read_bytes() == b"0123456789"


def test_the_launchers_log_is_replaced_whole_and_only_by_a_complete_stream(setup, tmp_path):
    s = setup
    s.remote(1, 0, b"x\n")
    mpilog = s.rd / "a1" / "mpirun.log"
    mpilog.write_bytes(b"mpirun said this\n")
    local = tmp_path / "here" / "launcher" / "a1-node0-mpirun.log"
    s.gather([0], str(mpilog), local)
    assert local.read_bytes() == b"mpirun said this\n"
    sink = runlogs._Gathered(s.run, local)
    sink.write(b"L 100\npartial")
    sink.close(False)  # the connection broke: the copy stays as it was, no temporary file left
    assert local.read_bytes() == b"mpirun said this\n"
    assert sorted(p.name for p in local.parent.iterdir()) == [local.name]


def test_an_unreadable_stream_is_an_error_not_a_guess(setup):
    with pytest.raises(OrchError, match="unreadable gather stream"):
        runlogs._Gathered(setup.run, None).write(b"garbage here\n")


def test_a_new_copy_appears_whole_or_not_at_all(setup):
    """As Transport.get writes one: a broken stream (or a full disk here) leaves no half copy,
    so no space is held by it and the next gather starts it again."""
    s = setup
    sink = runlogs._Gathered(s.run, None)
    sink.write(b"D 1 0 0 10\n01234")
    sink.close(False)
    assert not s.run.local_log(0).exists()
    assert list(s.run.local_log(0).parent.iterdir()) == []


def test_a_host_that_cannot_be_reached_is_asked_once_one_that_answered_gets_its_launcher_log(tmp_path):
    """gather with the launcher's log (msrun: every host writes one): a host whose gather failed
    but that answered has its launcher log read alone; an unreachable one is not asked again
    (each new try would cost it a connect timeout, host after host)."""
    from orchestrator.errors import ConnectError
    from orchestrator.transport.base import Result

    calls: dict[str, list[str]] = {}

    class Conn:
        def __init__(self, name):
            self.name = name

        def run(self, argv, sink=None):
            calls.setdefault(self.name, []).append("run")
            if self.name == "down":
                raise ConnectError(self.name, "connection refused")
            return Result(self.name, "gather", 0 if self.name == "fine" else 1, b"", b"no python", 0.0)

        def get(self, remote, local):
            calls[self.name].append("get")
            return 0

    hosts = [SimpleNamespace(name=n) for n in ("down", "broken", "fine")]
    plan = SimpleNamespace(hosts=hosts, all_hosts=hosts, launch_host=hosts[0], by_host=lambda name: (),
                           node_rank=lambda name: [h.name for h in hosts].index(name))
    cluster = SimpleNamespace(job=SimpleNamespace(workdir="/w", launcher="msrun"), ssh=SimpleNamespace(fanout=4))
    pool = type("Pool", (), {"__getitem__": lambda self, h: Conn(h.name)})()
    out = runlogs.gather(FakeRun(tmp_path), cluster, plan, pool, launcher_attempt=1)
    assert calls == {"down": ["run"], "broken": ["run", "get"], "fine": ["run"]}
    assert out["fine"] == "ok" and "refused" in out["down"] and "no python" in out["broken"]
