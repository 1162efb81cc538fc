"""Log gathering in one round trip per host: runlogs.gather_script (what runs on the host, here run
locally: a tar stream of the host's logs, or GATHER_PY with python3 -S) and its stream's sinks
(runlogs._Untar, runlogs._Gathered), end to end on files."""

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

    def gather(ranks, launcher: str | None = None, local_launcher: Path | None = None, env=None,
               cut: int | None = None) -> bytes:
        """One host's gather, its output delivered in pieces as a transport does (`cut`: only
        that many bytes of it, the connection broken)."""
        have = runlogs._have(run, ranks)
        res = subprocess.run(["/bin/sh", "-c", runlogs.gather_script(run, cluster, ranks, launcher, have)],
                             capture_output=True, env=env)
        out = res.stdout[:cut]
        sink = runlogs._Gathered(run, local_launcher)
        untar = runlogs._Untar(sink, ranks, have, runlogs.tar_name(run, cluster, launcher))
        for i in range(0, len(out), 7):
            untar.write(out[i:i + 7])
        sink.close(untar.complete(res.returncode if cut is None else 255))
        return out

    return SimpleNamespace(run=run, rd=rd, remote=remote, gather=gather)


@pytest.fixture
def python_only(tmp_path):
    """A PATH with python3 and no tar: the host's gather falls back to GATHER_PY."""
    import os
    import shutil
    import sys

    d = tmp_path / "bin"
    d.mkdir()
    os.symlink(sys.executable, d / "python3")
    for tool in ("mkdir", "cat"):
        os.symlink(shutil.which(tool), d / tool)
    return {**os.environ, "PATH": str(d)}


@pytest.mark.parametrize("way", ["tar", "python"])
def test_every_attempt_of_the_hosts_ranks_and_only_new_bytes(setup, monkeypatch, python_only, way):
    """The same copies whichever way a host sends its logs: a tar stream (little here yet, tar
    there) or GATHER_PY's frames (more than TAR_SLACK here: only new bytes move; or no tar)."""
    s = setup
    env = python_only if way == "python" else None
    s.remote(1, 0, b"zero\n")
    s.remote(1, 1, b"one\n")
    s.remote(2, 1, b"one again\n")
    s.remote(1, 5, b"not this host's\n")
    out = s.gather([0, 1], env=env)
    assert out.startswith(b"T\n" if way == "tar" else b"D ")
    assert s.run.local_log(0).read_bytes() == b"zero\n"
    assert s.run.local_log(1, 2).read_bytes() == b"one again\n"
    assert not s.run.local_log(5).exists()
    s.remote(1, 0, b"zero\nmore\n")
    s.gather([0, 1], env=env)
    assert s.run.local_log(0).read_bytes() == b"zero\nmore\n"
    assert s.run.local_log(1).read_bytes() == b"one\n" and s.run.local_log(1, 2).read_bytes() == b"one again\n"
    monkeypatch.setattr(runlogs, "TAR_SLACK", 4)   # more than that here: only new bytes move
    s.remote(1, 0, b"zero\nmore\nyet more\n")
    out = s.gather([0, 1], env=env)
    assert s.run.local_log(0).read_bytes() == b"zero\nmore\nyet more\n"
    assert out == b"D 1 0 10 9\nyet more\n"  # only what is new moved


def test_a_tar_stream_cut_short_leaves_no_half_copy_and_names_only_the_hosts_ranks(setup):
    """A broken tar stream: no new copy appears half (the next gather starts it again); a tar
    member that is not one of the host's ranks' logs is not kept."""
    s = setup
    s.remote(1, 0, b"x" * 3000)
    s.remote(1, 1, b"y" * 10)
    s.remote(1, 7, b"not this host's\n")
    s.gather([0, 1], cut=2 + 512 + 1000)
    assert not s.run.local_log(0).exists() and not s.run.local_log(1).exists()
    assert list(s.run.local_log(0).parent.iterdir()) == []
    out = s.gather([0, 1])
    assert out.startswith(b"T\n") and b"rank.7" in out   # sent, but not this host's rank: left out
    assert s.run.local_log(0).read_bytes() == b"x" * 3000 and s.run.local_log(1).read_bytes() == b"y" * 10
    assert not s.run.local_log(7).exists()


def test_a_host_with_no_logs_sends_an_empty_stream(setup):
    setup.rd.mkdir(parents=True)
    out = setup.gather([0])
    assert out == b"T\n" and not setup.run.local_log(0).exists()


@pytest.mark.parametrize("way", ["tar", "python"])
def test_a_log_rewritten_there_is_fetched_again_from_its_start(setup, python_only, way):
    s = setup
    env = python_only if way == "python" else None
    s.remote(1, 0, b"a long first version\n")
    s.gather([0], env=env)
    s.remote(1, 0, b"short\n")
    s.gather([0], env=env)
    assert s.run.local_log(0).read_bytes() == b"short\n"


def test_bytes_another_command_copied_meanwhile_are_not_written_twice(setup):
    s = setup
    s.remote(1, 0, b"0123456789")
    argv = runlogs.gather_script(s.run, SimpleNamespace(job=SimpleNamespace(workdir=str(s.rd.parents[1]))), [0])
    out = subprocess.run(["/bin/sh", "-c", argv], capture_output=True, check=True).stdout[2:]  # (tar: `T` first)
    out = runlogs_frames(out)
    s.run.local_log(0).parent.mkdir(parents=True)
    s.run.local_log(0).write_bytes(b"0123")  # another `orch logs` got there first
    sink = runlogs._Gathered(s.run, None)
    sink.write(out)
    sink.close(True)
    assert s.run.local_log(0).read_bytes() == b"0123456789"


def runlogs_frames(tar: bytes) -> bytes:
    """A tar stream as the frames _Untar makes of it."""
    got = bytearray()

    class Sink:
        def write(self, data):
            got.extend(data)

    runlogs._Untar(Sink(), [0], {}, None).write(b"T\n" + tar)
    return bytes(got)


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
    sink = runlogs._Gathered(s.run, None)   # whole: in place, the user's alone, nothing else left there
    sink.write(b"D 1 0 0 10\n0123456789")
    sink.close(True)
    assert s.run.local_log(0).read_bytes() == b"0123456789"
    assert s.run.local_log(0).stat().st_mode & 0o777 == 0o600
    assert list(s.run.local_log(0).parent.iterdir()) == [s.run.local_log(0)]


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

        def run(self, script, sink=None):
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


def test_a_tar_stream_is_complete_only_to_its_end_and_with_tars_word(setup):
    """A tar stream that stops between two members (the connection broke) is not complete, nor one
    tar ended with an error (2); GNU tar's 1 (a file changed while read: what it sent of it is
    whole) is; so is an empty one from a host with no log."""
    s = setup
    s.remote(1, 0, b"x" * 600)
    s.remote(1, 1, b"y")
    tar = subprocess.run(["tar", "cf", "-", "a1/1/rank.0/stdout", "a1/1/rank.1/stdout"], cwd=s.rd,
                         capture_output=True, check=True).stdout

    def complete(data: bytes, rc: int) -> bool:
        sink = runlogs._Gathered(s.run, None)
        u = runlogs._Untar(sink, [0, 1], {}, None)
        u.write(data)
        sink.close(False)
        return u.complete(rc)

    assert complete(b"T\n" + tar, 0) and complete(b"T\n" + tar, 1)
    assert not complete(b"T\n" + tar, 2)
    assert not complete(b"T\n" + tar[:512 + 1024], 0)   # rank.0's member whole, then nothing
    assert complete(b"T\n", 0) and not complete(b"T\n", 2)
