"""The CLI's one error handler: exit codes, messages, saved tracebacks."""

from __future__ import annotations

import re

from click.testing import CliRunner

from orchestrator import __version__
from orchestrator import cli as climod


def run(*args, **kw):
    return CliRunner().invoke(climod.cli, list(args), **kw)


def test_version_and_help():
    assert run("--version").output.strip() == f"orch, version {__version__}"
    res = run("--help")
    assert res.exit_code == 0
    for cmd in ("check", "plan", "up", "status", "down", "logs", "lab"):
        assert re.search(rf"^\s+{cmd}\s", res.output, re.M), cmd


def test_typo_exits_2_naming_key_and_line(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("inventory:\n  hosts: [{address: a, connection: local}]\njob:\n  workdir: /w\n  comand: x\n")
    res = run("plan", str(f))
    assert res.exit_code == 2
    assert f"{f}:5: job.comand: unknown key 'comand'" in res.output
    assert "Traceback" not in res.output


def test_missing_file_exits_2(tmp_path):
    """The path once (it is the location), and how to name the file."""
    res = run("check", str(tmp_path / "nope.yaml"))
    assert res.exit_code == 2 and f"{tmp_path / 'nope.yaml'}: no such cluster file\n" in res.output, res.output
    assert "hint: is the path right? `orch COMMAND FILE` names it" in res.output
    assert res.output.count("nope.yaml") == 1


def test_unexpected_crash_saves_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(climod.tempfile, "tempdir", str(tmp_path))

    def boom(*a, **k):
        raise ZeroDivisionError("kaboom")

    monkeypatch.setattr(climod, "load", boom)
    res = run("plan", "x.yaml")
    assert res.exit_code == 70
    assert "internal error: ZeroDivisionError: kaboom" in res.output
    saved = list(tmp_path.glob("orch-crash-*.txt"))
    assert len(saved) == 1 and str(saved[0]) in res.output
    assert "Traceback" in saved[0].read_text() and "Traceback" not in res.output


def test_logs_without_runs_exits_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run("logs", "--rank", "0")
    assert res.exit_code == 2 and "no runs recorded" in res.output



def test_a_host_that_never_sends_its_banner_prints_no_traceback(tmp_path):
    """A TCP port that accepts and then says nothing (not an SSH server, or a hung one): one
    located failure per host, none of paramiko's own tracebacks on the terminal."""
    import socket
    import subprocess
    import sys
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # and never answer
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    port = srv.getsockname()[1]
    (tmp_path / "known_hosts").write_text("")
    (tmp_path / "cluster.yaml").write_text(
        f"inventory: {{hosts: [{{address: 127.0.0.1, port: {port}, user: u, known_hosts: known_hosts}}]}}\n"
        "ssh: {connect_timeout: 1, retries: 1, config_file: none}\njob: {workdir: /data/j, command: x}\n")
    try:
        res = subprocess.run([sys.executable, "-m", "orchestrator.cli", "check"], cwd=tmp_path, capture_output=True,
                             timeout=60, env={**__import__("os").environ, "SSH_AUTH_SOCK": ""})
    finally:
        stop.set()
        t.join(2)
        srv.close()
        for c in held:
            c.close()
    err = res.stderr.decode()
    assert res.returncode == 1, (res.stdout.decode(), err)
    assert "Traceback" not in err and "paramiko" not in err.lower(), err
    assert "SSH handshake with 127.0.0.1" in res.stdout.decode() + err


def test_dash_i_replaces_the_cluster_files_inventory(tmp_path, monkeypatch):
    """-i PATH (or ORCH_INVENTORY) runs a cluster file against another inventory, relative to
    the current directory; a cluster file without `inventory:` needs one."""
    (tmp_path / "inv.yaml").write_text("hosts: [{address: 10.9.9.1, slots: 2}, {address: 10.9.9.2, slots: 2}]\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cluster.yaml").write_text("inventory: nowhere.yaml\njob: {workdir: /data/j, command: x}\n")
    (tmp_path / "sub" / "bare.yaml").write_text("job: {workdir: /data/j, command: x}\n")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(climod.cli, ["plan", "sub/cluster.yaml", "-i", "inv.yaml"])
    assert r.exit_code == 0 and "4 ranks on 2 hosts" in r.output, r.output
    r = CliRunner().invoke(climod.cli, ["plan", "sub/bare.yaml"], env={"ORCH_INVENTORY": "inv.yaml"})
    assert r.exit_code == 0 and "10.9.9.2" in r.output, r.output
    r = CliRunner().invoke(climod.cli, ["plan", "sub/bare.yaml"])
    assert r.exit_code == 2 and "missing required key 'inventory' (or give one with -i/--inventory)" in r.output


REMOTE = "[warn] Epoll MOD(1) on fd 5 failed. [bold]x[/bold] [/]"


def test_status_prints_what_hosts_wrote_as_it_was_written(tmp_path, monkeypatch):
    """mpirun's `[warn] ...` is not a style tag: remote text is never read as markup."""
    from orchestrator import api
    from orchestrator.runstate import RunView

    view = RunView(state="failed", message=f"rank 1 on h1 failed: {REMOTE}", run_id="r1",
                   ranks=[{"rank": 0, "host": "h[1]", "device": 0, "pid": 7, "state": "[warn]", "exit_code": 1,
                           "signal": None}],
                   unreachable={"h2": REMOTE})
    monkeypatch.setattr(climod, "load", lambda f, h: type("C", (), {"name": "c"})())
    monkeypatch.setattr(api, "status", lambda *a, **k: view)
    res = run("status", str(tmp_path / "cluster.yaml"))
    assert res.exit_code == 1, res.output
    assert f"rank 1 on h1 failed: {REMOTE}" in res.output
    assert f"h2: unreachable: {REMOTE}" in res.output
    assert "[warn]" in res.output.split("\n", 3)[3] and "h[1]" in res.output


def test_every_console_reads_no_markup():
    """The rule behind the test above, everywhere: a rich Console in orch is built with
    markup=False (styles are given as Text), so no string a host sent is taken for a tag."""
    import ast
    from pathlib import Path

    root = Path(climod.__file__).parent
    found = 0
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Console":
                found += 1
                kw = {k.arg: k.value for k in node.keywords}
                assert isinstance(kw.get("markup"), ast.Constant) and kw["markup"].value is False, \
                    f"{path}:{node.lineno}: Console(...) without markup=False"
    assert found >= 2


def _view(state, hosts, per_host=2, rank_state="stopped"):
    from orchestrator.runstate import RunView

    ranks = [{"rank": i * per_host + j, "host": h, "state": rank_state} for i, h in enumerate(hosts)
             for j in range(per_host)]
    return RunView(state=state, ranks=ranks, run_id="r1")


def test_down_prints_one_line_per_outcome_never_one_per_host():
    """128 hosts: ranks stopped on 64, nothing left on the other 64, one host swept with KILL,
    two unreachable: folded lines, not 128 `HOST: none`."""
    hosts = [f"node{i:03d}" for i in range(1, 129)]
    view = _view("stopped", hosts[:64], per_host=8)
    stopped = {h: "none" for h in hosts[:126]}
    stopped["node100"] = "killed 4242 4243"
    unreachable = {"node127": "node127: timed out after 2s connecting to 10.0.0.127:22",
                   "node128": "node128: timed out after 2s connecting to 10.0.0.127:22"}
    lines = climod.down_lines(stopped, unreachable, view, stopped_now=True)
    assert lines == [
        ("stopped 8 ranks on node[001-064]; nothing of the run left running on node[065-099,101-126]; "
         "killed 2 processes still running after the grace period on node100", False),
        ("could not stop on node[127-128]: timed out after 2s connecting to 10.0.0.127:22", True)]


def test_down_of_a_run_that_had_ended_says_so_and_counts_no_rank_as_stopped_by_it(tmp_path, monkeypatch):
    from orchestrator import api, runs

    hosts = [f"node{i}" for i in range(1, 5)]
    rec = type("R", (), {"id": "r1", "finished": True, "data": {"state": "failed"}, "logs_dir": tmp_path,
                         "controller_alive": lambda self: False})()
    monkeypatch.setattr(runs, "load_run", lambda rid=None: rec)
    monkeypatch.setattr(api, "down", lambda rid: ({h: "none" for h in hosts}, {}, _view("failed", hosts)))
    res = run("down")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines == ["orch: nothing of the run left running on node[1-4]",
                     f"orch: run r1 had already ended: failed (its record is kept); logs in {tmp_path}"], lines
    assert "none" not in res.output


def test_status_with_no_runs_and_no_cluster_file_says_where_to_look(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run("status")
    assert res.exit_code == 2
    assert f"no runs recorded in {tmp_path}/.orch/runs and no cluster.yaml here" in res.output, res.output
    assert "`orch status FILE`" in res.output and "does not exist" not in res.output
