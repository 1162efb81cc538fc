"""One CLI grammar: --json on every command that reports (up, status, down; check and plan have
theirs), the same flags for the same ideas (--interface on plan, check and up), and tables that
never cut a value when stdout is not a terminal. One host, connection: local."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LONG = "a-host-name-long-enough-to-be-cut-by-an-eighty-column-table-" + "x" * 20


def orch(*args, cwd: Path, rc: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    if rc is not None:
        assert res.returncode == rc, (res.stdout, res.stderr)
    return res


def cluster(tmp_path: Path, command: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""name: js
inventory:
  hosts: [{{name: {LONG}, address: 127.0.0.1, connection: local, slots: 2}}]
job:
  workdir: {tmp_path / 'wd'}
  launcher: ranktable
  command: [sh, -c, {json.dumps(command)}]
""")
    return path


def test_up_json_is_one_object_with_the_outcome(tmp_path):
    cluster(tmp_path, 'echo "rank $RANK_ID"')
    res = orch("up", "--json", "--skip-checks", cwd=tmp_path, rc=0)
    doc = json.loads(res.stdout)  # stdout holds the object and nothing else: no rank output
    assert doc["state"] == "succeeded" and doc["exit_code"] == 0 and doc["exit_codes"] == {"0": 0, "1": 0}
    assert Path(doc["logs"]).is_dir() and doc["logs_missing"] == [] and doc["run"] in doc["logs"]
    cluster(tmp_path, '[ "$RANK_ID" = 1 ] && exit 3; sleep 30')
    doc = json.loads(orch("up", "--json", "--skip-checks", cwd=tmp_path, rc=1).stdout)
    assert doc["state"] == "failed" and doc["exit_code"] == 1
    assert doc["first_failure"]["rank"] == 1 and doc["first_failure"]["exit_code"] == 3


def test_detached_then_status_and_down_json(tmp_path):
    cluster(tmp_path, "sleep 60")
    doc = json.loads(orch("up", "--json", "--detach", "--skip-checks", cwd=tmp_path, rc=0).stdout)
    assert doc["state"] == "detached" and doc["exit_code"] == 0
    run = doc["run"]
    st = json.loads(orch("status", "--json", cwd=tmp_path, rc=0).stdout)
    assert st["run"] == run and st["state"] in ("starting", "running")
    down = json.loads(orch("down", "--json", cwd=tmp_path, rc=0).stdout)
    assert down["run"] == run and down["state"] == "stopped" and down["unreachable"] == {}
    assert set(down["stopped"]) == {LONG}
    st = json.loads(orch("status", "--json", "--run", run, cwd=tmp_path, rc=4).stdout)
    assert st["state"] == "stopped" and {r["state"] for r in st["ranks"]} == {"stopped"}


def test_tables_keep_every_value_whole_when_not_on_a_terminal(tmp_path):
    cluster(tmp_path, "true")
    assert LONG in orch("plan", cwd=tmp_path, rc=0).stdout
    orch("up", "-q", "--skip-checks", cwd=tmp_path, rc=0)
    out = orch("status", cwd=tmp_path, rc=0).stdout
    assert LONG in out and "…" not in out, out
    out = orch("check", cwd=tmp_path).stdout
    assert LONG in out and "…" not in out, out


def test_interface_is_one_flag_for_plan_check_and_up(tmp_path):
    """--interface sets job.interface wherever a command reads the cluster file."""
    path = cluster(tmp_path, "true")
    path.write_text(path.read_text().replace("launcher: ranktable", "launcher: mpirun"))
    orch("plan", "--interface", "eth9", "--out", str(tmp_path / "p"), cwd=tmp_path, rc=0)
    assert "eth9" in (tmp_path / "p" / "commands.json").read_text()
    assert "eth9" not in orch("plan", "--out", str(tmp_path / "q"), cwd=tmp_path, rc=0).stdout + \
        (tmp_path / "q" / "commands.json").read_text()
    probe = orch("check", "--interface", "eth9", "--print-probe", LONG, cwd=tmp_path, rc=0).stdout
    assert "eth9" in probe and "eth9" not in orch("check", "--print-probe", LONG, cwd=tmp_path, rc=0).stdout
    assert "--interface" in orch("up", "--help", cwd=tmp_path, rc=0).stdout


def test_up_json_when_the_preflight_fails_is_still_one_object(tmp_path):
    """Nothing started: stdout holds the check's results as one object, exit 3."""
    path = cluster(tmp_path, "true")
    path.write_text(path.read_text().replace("launcher: ranktable", "launcher: ranktable\n  sync: [missing.py]"))
    res = orch("up", "--json", cwd=tmp_path, rc=3)
    doc = json.loads(res.stdout)
    assert doc["state"] == "preflight_failed" and doc["exit_code"] == 3 and doc["run"] is None
    assert not doc["check"]["ok"] and any(r["status"] == "fail" for r in doc["check"]["results"])


def test_json_errors_are_one_object_too(tmp_path):
    """With --json, an error before anything is known (a bad file, no such run) is still one object
    on stdout, with the exit code and the message stderr shows."""
    (tmp_path / "cluster.yaml").write_text("inventory: {hosts: [{address: x}]}\njob: {workdir: rel, command: x}\n")
    for argv, rc in ((["up", "--json"], 2), (["check", "--json"], 2), (["plan", "--json"], 2),
                     (["status", "--json", "--run", "nope"], 2), (["down", "--json"], 2)):
        res = orch(*argv, cwd=tmp_path, rc=rc)
        doc = json.loads(res.stdout)
        assert doc["state"] == "error" and doc["exit_code"] == rc and doc["message"] in res.stderr, argv
    assert orch("up", cwd=tmp_path, rc=2).stdout == ""  # without --json: nothing on stdout


def test_help_shows_the_default_file(tmp_path):
    for cmd in ("check", "plan", "up"):
        assert "[FILE, default ./cluster.yaml]" in orch(cmd, "--help", cwd=tmp_path, rc=0).stdout.splitlines()[0]
    assert "else ./cluster.yaml]" in " ".join(orch("status", "--help", cwd=tmp_path, rc=0).stdout.split())


# `orch` as a program (main()) with an atexit handler, and a callback of the usual exit's first
# step (threading's shutdown, before the atexit handlers and the teardown; private, but the one
# step os._exit skips that a finalizer frozen by gc.freeze cannot hide): which ran says how the
# program ended
ENDS = """
import atexit, sys, threading
threading._register_atexit(lambda: sys.stderr.write("orch-test: the usual exit\\n"))
atexit.register(lambda: sys.stderr.write("orch-test: atexit\\n"))
from orchestrator.cli import main
sys.argv = ["orch"] + sys.argv[1:]
main()
"""


def orch_program(*args, cwd: Path, rc: int) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", ENDS, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert res.returncode == rc, (args, res.stdout, res.stderr)
    return res


def ended_at_once(res: subprocess.CompletedProcess) -> bool:
    """The program ran its atexit handlers and skipped the interpreter's teardown."""
    assert "orch-test: atexit" in res.stderr, res.stderr
    return "orch-test: the usual exit" not in res.stderr


def test_up_status_and_down_end_at_once_with_their_whole_output_and_exit_code(tmp_path):
    """`orch up`, `status`, `down` and `check` (--print-probe too) as the program end once their
    output is out (cli._end: os._exit, atexit handlers run, no teardown), with the exit code and
    every byte of output, into a pipe; `orch logs` ends as before."""
    cluster(tmp_path, 'echo "rank $RANK_ID"')
    res = orch_program("up", "--json", "--skip-checks", cwd=tmp_path, rc=0)
    assert json.loads(res.stdout)["state"] == "succeeded" and ended_at_once(res)
    res = orch_program("status", cwd=tmp_path, rc=0)
    assert LONG in res.stdout and "succeeded" in res.stdout and ended_at_once(res)
    res = orch_program("down", cwd=tmp_path, rc=0)
    assert "had already ended: succeeded" in res.stderr and ended_at_once(res)
    res = orch_program("logs", cwd=tmp_path, rc=0)
    assert res.stdout == "[rank 0] rank 0\n[rank 1] rank 1\n" and not ended_at_once(res)
    cluster(tmp_path, '[ "$RANK_ID" = 1 ] && exit 3; sleep 30')
    res = orch_program("up", "--skip-checks", "-q", cwd=tmp_path, rc=1)
    assert "failed" in res.stderr and ended_at_once(res)
    cluster(tmp_path, "sleep 60")
    res = orch_program("up", "--detach", "--skip-checks", cwd=tmp_path, rc=0)
    run = res.stdout.strip()
    assert run and ended_at_once(res)
    res = orch_program("status", "--json", cwd=tmp_path, rc=0)
    assert json.loads(res.stdout)["run"] == run and ended_at_once(res)
    res = orch_program("down", "--json", cwd=tmp_path, rc=0)
    assert json.loads(res.stdout)["state"] == "stopped" and ended_at_once(res)
    res = orch_program("check", "--json", cwd=tmp_path, rc=0)
    assert json.loads(res.stdout)["ok"] and ended_at_once(res)
    res = orch_program("check", "--print-probe", LONG, cwd=tmp_path, rc=0)
    assert res.stdout.startswith(f"# orch check probe for {LONG}") and res.stdout.endswith("\n")
    assert ended_at_once(res)
