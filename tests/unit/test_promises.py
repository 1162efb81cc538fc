"""README's "What orch promises", the part that holds without a lab: one test (or a few) per
promise, each through a stable entry point (the CLI through click's runner, spec.load_cluster,
hostsets, the agent package, the transport) so it outlives code moving between modules.

Each test here was seen failing on a deliberately broken copy of the code (the 4 MB limit set to
1 TB, the expansion limit removed, exit codes above 128 called signals, ...); the promises that
need real hosts are held by tests/faults (README names them)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import cli as climod
from orchestrator.errors import SpecError
from orchestrator.spec import load_cluster

LOCAL = "inventory:\n  hosts: [{address: 'n[1-2]', connection: local, slots: 2}]\n"
JOB = "job: {workdir: /data/j, command: 'python x.py'}\n"


def orch(*args: str):
    """`orch ARGS` in this process (click's runner): (exit code, everything it printed)."""
    res = CliRunner().invoke(climod.cli, list(args))
    return res.exit_code, res.output


def cluster_file(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, newline="")
    return p


def refused(tmp_path: Path, text: str, line: int | None) -> str:
    """`orch plan` of a cluster file that must be refused: exit 2, one located error, no
    traceback. Returns the output."""
    f = cluster_file(tmp_path, text)
    rc, out = orch("plan", str(f))
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert f"{f}:{line}:" in out if line is not None else f"{f}:" in out, out
    return out


# --------------------------------------------------------------------------- Bounded input
# Cluster files over 4 MB, YAML alias bombs (over 200k values), NUL bytes, control characters and
# `slots` above 1024 are exit 2 with file and line, at once.

def test_a_cluster_file_over_4_mb_is_refused_unread(tmp_path):
    text = LOCAL + JOB
    text += "#" * ((4 << 20) + 1 - len(text))  # one byte over
    out = refused(tmp_path, text, None)
    assert "orch reads at most 4 MB" in out, out


def _values(n: int) -> str:
    """A file whose YAML holds about n values, through aliases (`&a [x, x, ...]`, `*a` repeated)."""
    per = 1000
    return ("x: &a [" + ", ".join(["v"] * per) + "]\n"
            "y: [" + ", ".join(["*a"] * (n // per)) + "]\n")


def test_an_alias_bomb_over_200k_values_is_refused_with_its_line(tmp_path):
    out = refused(tmp_path, _values(201_000) + LOCAL + JOB, 1)  # the aliased values
    assert "expands to more than 200000 values" in out, out


def test_200k_values_less_a_little_are_read(tmp_path):
    with pytest.raises(SpecError) as exc:  # read whole: only what the file means is wrong
        load_cluster(cluster_file(tmp_path, _values(190_000) + LOCAL + JOB))
    assert "unknown key 'x'" in str(exc.value)


@pytest.mark.parametrize("text, line, needle", [
    (LOCAL + JOB + "\0\n", 4, "a NUL byte"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\\0b\"}\n", 3, "a NUL character"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x01b\"}\n", 3, "YAML error"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x1bb\"}\n", 3, "YAML error"),
])
def test_nul_bytes_and_control_characters_are_refused_with_their_line(tmp_path, text, line, needle):
    out = refused(tmp_path, text, line)
    assert needle in out, out


def test_slots_above_1024_are_refused_with_their_line(tmp_path):
    text = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1025}\n" + JOB
    out = refused(tmp_path, text, 3)
    assert "more than 1024 ranks on one host" in out, out
    ok = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1024}\n" + JOB
    assert load_cluster(cluster_file(tmp_path, ok)).hosts[0].slots == 1024


# --------------------------------------------------------------------------- No hangs
# An `n[1-99999999]` typo is an error, not an hour of expansion. (The limit is 100000 names; a
# pattern one over it is refused before anything is built, wherever a pattern is read.)

OVER = "m[1-100001]"
EXPANSION_PLACES = {
    "address": f"inventory:\n  hosts:\n    - {{address: '{OVER}', connection: local}}\n" + JOB,
    "name": f"inventory:\n  hosts:\n    - {{address: '10.0.0.[1-2]', name: '{OVER}', connection: local}}\n" + JOB,
    "group": f"{LOCAL}  groups: {{g: ['{OVER}']}}\n" + JOB,
}


@pytest.mark.parametrize("where", sorted(EXPANSION_PLACES))
def test_a_host_range_over_100000_names_is_an_error_with_its_line(tmp_path, where):
    out = refused(tmp_path, EXPANSION_PLACES[where], 3)
    assert f"it expands to 100001 names; at most 100000 are allowed: \"{OVER}\"" in out, out


def test_a_host_range_over_100000_names_in_hosts_option_is_an_error(tmp_path):
    rc, out = orch("plan", str(cluster_file(tmp_path, LOCAL + JOB)), "--hosts", "n1,n[1-400]-[1-300]")
    assert rc == 2 and "it expands to 120001 names; at most 100000 are allowed" in out, out


def test_a_host_range_is_counted_without_being_expanded():
    """What makes the README's `n[1-99999999]` an error at once: its size is counted, never built."""
    from orchestrator import hostsets
    assert hostsets.range_size("n[1-99999999]") == 99999999
    assert hostsets.range_size("n[1-10/2],m[1-3]-[1-4]") == 5 + 12


# --------------------------------------------------------------------------- What failed is said
# ... exit codes above 128 are called signals only when they are.

def test_an_exit_code_above_128_is_an_exit_code_and_a_signal_is_a_signal():
    from orchestrator.agent.states import describe
    assert describe(137) == "exit code 137" and describe(255, None) == "exit code 255"
    assert describe(None, 9) == "killed by signal 9 (SIGKILL)"
    assert describe(None, 15) == "killed by signal 15 (SIGTERM)"


@pytest.mark.parametrize("script, code, sig", [("exit 137", 137, None), ("exit 143", 143, None),
                                               ("kill -KILL $$", None, 9)])
def test_the_supervisor_records_what_waitpid_says(tmp_path, script, code, sig):
    """A rank's end as the host's supervisor records it: a shell's `exit 137` stays exit code 137;
    only a process a signal killed has a signal."""
    import subprocess
    import time

    from orchestrator.agent.procs import Local
    local = Local({"run_id": "r", "rundir": str(tmp_path), "host": "h", "launcher": "ranktable"}, lambda t: None)
    proc = subprocess.Popen(["sh", "-c", script])
    proc.returncode = 0   # reaped by Local, as the supervisor's children are
    rec = {"key": "rank.0", "rank": 0, "pid": proc.pid, "exit_code": None, "signal": None, "start": 0, "end": None}
    local.children[proc.pid] = rec
    for _ in range(3000):   # until waitpid has it (the loop, not a timed assert: 30 s at most)
        local.reap()
        if rec["end"] is not None:
            break
        time.sleep(0.01)
    assert (rec["exit_code"], rec["signal"]) == (code, sig)


@pytest.mark.parametrize("code, sig, how", [(137, None, "exit code 137"), (None, 9, "killed by signal 9 (SIGKILL)")])
def test_the_runs_message_calls_a_signal_a_signal_only_when_it_is_one(code, sig, how):
    """What `orch up` and `orch status` print for a failed rank: the head's first failure."""
    from orchestrator.agent import head as H
    from tests.unit.test_head import T0, rep, running
    head = running()
    H.decide(head, [rep(head, "b", {3: ("failed", code, sig, T0 + 5)})], T0 + 6)
    assert head.doc["first_failure"]["how"] == how
    assert f"rank 3 on b (device 1) failed: {how}" in head.doc["message"]
    assert ("signal" in head.doc["message"]) == (sig is not None)


# --------------------------------------------------------------------------- Secrets kept
# Secret env values (`job.secret_env`, `*_TOKEN`, `*_KEY`, `*_SECRET`, `*PASSWORD*`) reach ... nothing
# else: not run records, printed output, plan files, errors. (The ranks' environment and the
# hosts' command lines need hosts: tests/faults/test_secrets.py.)

SECRETS = {"HF_TOKEN": "S3cr3t-token-1", "AWS_KEY": "S3cr3t-key-22", "APP_SECRET": "S3cr3t-secret-333",
           "DB_PASSWORD_FILE": "S3cr3t-pw-4444", "my_passwd": "S3cr3t-pw-55555", "PLAIN_NAME": "S3cr3t-chosen-6"}


def _secret_cluster(launcher: str) -> str:
    env = ", ".join(f"{k}: {v}" for k, v in SECRETS.items())
    return (f"inventory:\n  hosts:\n    - {{address: 'n[1-2]', connection: local, slots: 2, "
            f"env: {{HOST_TOKEN: S3cr3t-host-77}}}}\n"
            f"job:\n  workdir: /data/j\n  launcher: {launcher}\n  secret_env: [PLAIN_NAME]\n"
            f"  command: python x.py --token S3cr3t-token-1 --pw=S3cr3t-pw-4444\n"
            f"  env: {{{env}, SEEN: visible-value}}\n")


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_secret_values_reach_no_plan_file_and_no_output(tmp_path, launcher):
    f = cluster_file(tmp_path, _secret_cluster(launcher))
    out_dir = tmp_path / "out"
    rc1, printed = orch("plan", str(f), "--out", str(out_dir))
    rc2, as_json = orch("plan", str(f), "--json")
    assert (rc1, rc2) == (0, 0), printed + as_json
    written = {p.name: p.read_text() for p in out_dir.iterdir()}
    assert {"plan.json", "commands.json"} <= set(written), sorted(written)
    everything = printed + as_json + "".join(written.values())
    assert "S3cr3t" not in everything
    assert "visible-value" in "".join(written.values())   # plain values are shown: the search looked in the right place
    for name in [*SECRETS, "HOST_TOKEN"]:
        assert name in everything, name


def test_a_run_record_holds_no_secret_value(tmp_path):
    """What `orch up` records here (runs.create_run: the cluster file's text, the model, the
    plan) has every secret value masked, and is readable by this user alone."""
    from orchestrator import runs
    f = cluster_file(tmp_path, _secret_cluster("mpirun"))
    run = runs.create_run(load_cluster(f), {}, cwd=tmp_path)
    record = (run.dir / "run.json").read_text()
    assert "S3cr3t" not in record
    assert "visible-value" in record and runs.MASK in json.loads(record)["cluster_text"]
    assert (run.dir / "run.json").stat().st_mode & 0o077 == 0


def test_a_bad_secret_value_is_an_error_that_does_not_quote_it(tmp_path):
    out = refused(tmp_path, LOCAL + "job: {workdir: /data/j, command: x, env: {HF_TOKEN: [S3cr3t-token-1]}}\n", 3)
    assert "HF_TOKEN" in out and "S3cr3t" not in out, out


# --------------------------------------------------------------------------- A full disk here is said
# ... a run.json that cannot be written is a located error, never a crash. (Logs that could not
# be brought back need a run: tests/faults/test_logs.py.)

def test_a_run_record_that_cannot_be_written_is_a_located_error(tmp_path):
    from orchestrator import runs
    from orchestrator.errors import LocalWriteError
    run = runs.create_run(load_cluster(cluster_file(tmp_path, LOCAL + JOB)), {}, cwd=tmp_path)
    (run.dir / "run.json").unlink()
    (run.dir / "run.json").mkdir()      # what a full or read-only disk does to a write, as root too
    with pytest.raises(LocalWriteError) as exc:
        run.save()
    assert f"cannot write {run.dir / 'run.json'}: Is a directory" in str(exc.value) and exc.value.exit_code == 5


def test_a_run_directory_that_cannot_be_made_is_a_located_error(tmp_path):
    from orchestrator import runs
    from orchestrator.errors import LocalWriteError
    (tmp_path / ".orch").write_text("")  # in the way of .orch/runs
    with pytest.raises(LocalWriteError) as exc:
        runs.create_run(load_cluster(cluster_file(tmp_path, LOCAL + JOB)), {}, cwd=tmp_path)
    assert str(tmp_path / ".orch" / "runs") in str(exc.value) and "Not a directory" in str(exc.value)


# --------------------------------------------------------------------------- No neighbour can slip code in
# `orch check` fails a workdir, or any parent, writable by group or others (root's sticky dirs such as
# /tmp excepted) or owned by another user, with the fix; system directories are refused as workdir
# (tests/unit/test_spec.py::test_a_system_directory_is_never_a_workdir).

def _workdir_check(tmp_path: Path, workdir: Path) -> dict:
    """`orch check --json` of a cluster of this machine (connection: local): the workdir result."""
    f = cluster_file(tmp_path, "inventory:\n  hosts: [{address: n1, connection: local}]\n"
                               f"job: {{workdir: '{workdir}', command: 'true'}}\n")
    rc, out = orch("check", str(f), "--json")
    (res,) = [r for r in json.loads(out)["results"] if r["check"] == "workdir"]
    assert rc in (0, 1) and (rc == 1 or res["status"] != "fail"), out
    return res


@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o775, "its group"), (0o757, "others"),
                                       (0o1777, None), (0o755, None)])
def test_a_workdir_under_a_directory_others_can_write_fails_the_check_with_the_fix(tmp_path, mode, who):
    """A parent (here, the directory above the workdir) others could write to: a neighbour could
    swap what the ranks run. A sticky directory of root's (as /tmp) is fine."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    if mode & 0o1000 and __import__("os").getuid() != 0:
        who = "group and others"   # sticky, but not root's
    res = _workdir_check(tmp_path, parent / "job")
    if who is None:
        assert res["status"] == "pass", res
        return
    assert res["status"] == "fail", res
    assert f"{parent} is writable by {who} (mode {mode & 0o777:o}); fix: chmod go-w {parent}" in res["message"], res


@pytest.mark.skipif(__import__("os").getuid() != 0, reason="giving a directory to another user needs root")
@pytest.mark.parametrize("sticky", [False, True])
def test_a_workdir_owned_by_another_user_fails_the_check(tmp_path, sticky):
    import os
    wd = tmp_path / "job"
    wd.mkdir(mode=0o1755 if sticky else 0o755)
    os.chown(wd, 54321, 54321)
    res = _workdir_check(tmp_path, wd)
    assert res["status"] == "fail" and f"{wd} is owned by uid 54321" in res["message"], res


# --------------------------------------------------------------------------- No injection
# ... for mpirun a workdir or log_dir holding `$`, a backtick, `"`, `\` or `!` is refused up front
# (exit 2, with the line). (That every value reaches the rank byte-for-byte needs hosts:
# tests/faults/test_hostile.py; the quoting itself: tests/unit/test_sh.py.)

@pytest.mark.parametrize("char", ["$", "`", '"', "\\", "!"])
@pytest.mark.parametrize("key", ["workdir", "log_dir"])
def test_mpirun_refuses_a_workdir_or_log_dir_its_remote_shell_would_expand(tmp_path, key, char):
    value = f"/data/a{char}b" if key == "workdir" else f"logs/a{char}b"
    quoted = json.dumps(value)   # a YAML double-quoted scalar
    job = {"workdir": '"/data/j"', "log_dir": '"logs"', key: quoted}
    text = LOCAL + "job:\n  command: x\n" + "".join(f"  {k}: {v}\n" for k, v in job.items())
    line = 5 + list(job).index(key)   # after LOCAL (2 lines), `job:` and `command:`
    out = refused(tmp_path, text, line)
    assert f"job.{key}: {key} {value!r} contains {char}" in out, out
    ranktable = text.replace("job:\n", "job:\n  launcher: ranktable\n")
    assert getattr(load_cluster(cluster_file(tmp_path, ranktable)).job, key) == value
