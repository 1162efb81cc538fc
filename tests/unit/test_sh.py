"""sh: the shell text orch builds (pinned, valid sh, run for real in a local sh), and Secret values:
masked in whatever is printed or recorded, real in whatever runs."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest

from orchestrator import launchers, sh, supervisor
from orchestrator.launchers import show
from orchestrator.rankplan import make_plan
from orchestrator.runs import create_run
from orchestrator.spec import Cluster, Host, Job

NASTY = "it's $(touch /tmp/orch-sh-pwned) `x` \"q\" \\ ;|&\n*"


def run_sh(script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0, script
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": os.environ["PATH"], **(env or {})})


# --------------------------------------------------------------------------- pinned text


PINNED = {
    "exports": ("\n".join(sh.exports({"A": "1", "B": "x y", "C": sh.Secret("s'x")})),
                "export A=1\nexport B='x y'\nexport C='s'\"'\"'x'"),
    "assignments": (sh.assignments({"ORCH_RUN_ID": "r1", "ORCH_AGENT": "1"}), "ORCH_RUN_ID=r1 ORCH_AGENT=1"),
    "with_env": (sh.with_env({"PATH": "/opt/bin:/usr/bin"}, "command -v x"),
                 "(\nexport PATH=/opt/bin:/usr/bin\ncommand -v x\n)"),
    "with_env_empty": (sh.with_env({}, "true"), "true"),
    "record_exit": (sh.record_exit("exec sleep 1", "/w/a b/r.rc"),
                    "exec 3>&2 2>/dev/null\n( exec 2>&3 3>&-\nexec sleep 1\n)\nrc=$?\n"
                    "echo $rc > '/w/a b/r.rc.tmp' && mv -f '/w/a b/r.rc.tmp' '/w/a b/r.rc'\nexit $rc"),
    "env_holders": (sh.env_holders("ORCH_RUN_ID", "r 1"),
                    "grep -lzxF -- 'ORCH_RUN_ID=r 1' /proc/[0-9]*/environ 2>/dev/null"),
    "pids_function": (sh.pids_function("ORCH_RUN_ID", "r1"),
                      "find_pids() { grep -lzxF -- ORCH_RUN_ID=r1 /proc/[0-9]*/environ 2>/dev/null "
                      "| cut -d/ -f3 | grep -vx \"$$\"; }\n"),
    "env_values": (sh.env_values("ORCH_RUN_ID"),
                   "LC_ALL=C grep -a -s -z -H -o '^ORCH_RUN_ID=[ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                   "0123456789._-]*' /proc/[0-9]*/environ | tr '\\0' '\\n'"),
}


@pytest.mark.parametrize("name", PINNED)
def test_text_is_pinned_and_valid_sh(name):
    got, want = PINNED[name]
    assert got == want
    assert subprocess.run(["sh", "-n"], input=got + ("\nfind_pids" if name == "pids_function" else ""),
                          text=True).returncode == 0


def test_bad_names_are_refused():
    for bad in ("", "1A", "A-B", "A B", "A;B", "É"):
        with pytest.raises(ValueError):
            sh.exports({bad: "x"})


# --------------------------------------------------------------------------- run for real


def test_exports_with_env_and_assignments_keep_any_value_exactly():
    env = {"V": NASTY, "S": sh.Secret(NASTY + "secret")}
    out = run_sh("\n".join(sh.exports(env)) + "\nprintf '%s|%s' \"$V\" \"$S\"").stdout
    assert out == f"{NASTY}|{NASTY}secret"
    out = run_sh(sh.with_env(env, "printf '%s' \"$V\"") + "\nprintf '|%s' \"${V-unset}\"").stdout
    assert out == f"{NASTY}|unset"  # exported inside the subshell only
    out = run_sh(sh.assignments(env) + " sh -c 'printf %s \"$S\"'").stdout
    assert out == NASTY + "secret"
    assert not Path("/tmp/orch-sh-pwned").exists()


def test_record_exit_writes_the_code_and_exits_with_it(tmp_path):
    rc = tmp_path / "d d" / "x.rc"
    rc.parent.mkdir()
    res = run_sh(sh.record_exit("echo out; echo err >&2; exit 7", str(rc)))
    assert res.returncode == 7 and rc.read_text() == "7\n" and not rc.with_name("x.rc.tmp").exists()
    assert res.stdout == "out\n" and res.stderr == "err\n"
    res = run_sh(sh.record_exit("sh -c 'kill -KILL $$'", str(rc)))  # a signal: 128+9, and no shell note on stderr
    assert res.returncode == 137 and rc.read_text() == "137\n" and res.stderr == ""


def test_the_proc_scan_finds_a_runs_processes():
    run_id = f"t-{os.getpid()}-x y"
    p = subprocess.Popen(["sleep", "30"], env={"PATH": os.environ["PATH"], "ORCH_RUN_ID": run_id})
    try:
        assert run_sh(sh.env_holders("ORCH_RUN_ID", run_id)).stdout.split() == [f"/proc/{p.pid}/environ"]
        assert run_sh(sh.env_holders("ORCH_RUN_ID", run_id[:-1])).stdout == ""  # the whole value, not a prefix
        assert run_sh(sh.pids_function("ORCH_RUN_ID", run_id) + "find_pids").stdout.split() == [str(p.pid)]
        lines = run_sh(sh.env_values("ORCH_RUN_ID")).stdout.splitlines()
        # a value is cut at its first character outside ENV_VALUE_CHARS (orch's run ids have none)
        assert f"/proc/{p.pid}/environ:ORCH_RUN_ID={run_id.split()[0]}" in lines
    finally:
        p.kill()
        p.wait()


def test_shown_tree_masks_a_secret_wherever_it_is_and_keeps_the_rest():
    from types import MappingProxyType

    s = sh.Secret("hunter2-value")
    tree = {"a": [s, ("x", {"k": s, "n": None, "b": True, "i": 3, "f": 0.5})],
            "m": MappingProxyType({"deep": [s]}), "s": "plain"}
    got = sh.shown_tree(tree)
    assert got == {"a": [sh.MASK, ["x", {"k": sh.MASK, "n": None, "b": True, "i": 3, "f": 0.5}]],
                   "m": {"deep": [sh.MASK]}, "s": "plain"}
    assert "hunter2" not in json.dumps(got) and sh.secrets_in(got) == [] and sh.secrets_in(tree) == [s, s, s]
    assert type(got["a"][1][1]["b"]) is bool and type(got["s"]) is str


def test_secret_is_its_value_to_code_and_masked_when_shown():
    s = sh.Secret("hunter2-value")
    assert s == "hunter2-value" and f"{s}" == "hunter2-value" and json.dumps(s) == '"hunter2-value"'
    assert sh.shown(s) == sh.MASK and "hunter2" not in repr(s) and sh.shown("plain") == "plain"
    back = pickle.loads(pickle.dumps(sh.Secret("v", "x=***")))
    assert isinstance(back, sh.Secret) and back == "v" and back.shown == "x=***"
    assert sh.shown_join(["a", s, "b c"]) == "a '***' 'b c'"
    assert sh.mark({"A_TOKEN": "t", "B": "b"}, lambda k: k.endswith("TOKEN")) == {"A_TOKEN": "t", "B": "b"}
    assert [type(v) for v in sh.mark({"A_TOKEN": "t", "B": "b"}, lambda k: k.endswith("TOKEN")).values()] == \
        [sh.Secret, str]


HOST_SECRET = "hostkey-0123456789"
JOB_SECRET = "tok-abcdefghij"
LISTED = "listed-9876543210"


def secret_cluster(tmp_path: Path, launcher: str) -> Cluster:
    hosts = tuple(Host(name=f"h{i}", address=f"10.0.0.{i}", user="root", slots=2, devices=(0, 1),
                       env={"HOST_API_KEY": HOST_SECRET, "PLAIN_H": "ph"}) for i in (1, 2))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"# {JOB_SECRET}\n")
    return Cluster(name="t", path=path, hosts=hosts,
                   job=Job(workdir="/data/job", command=("python3", "train.py", f"--token={JOB_SECRET}"),
                           launcher=launcher, platform="cpu", secret_env=("MY_CRED",),
                           env={"HF_TOKEN": JOB_SECRET, "MY_CRED": LISTED, "LR": "0.1"}))


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable", "msrun", "torchrun"])
def test_secrets_in_no_printed_or_recorded_command_and_in_every_executed_one(tmp_path, launcher):
    c = secret_cluster(tmp_path, launcher)
    plan = make_plan(c)
    secrets = (JOB_SECRET, LISTED, HOST_SECRET)

    # printed/recorded: `orch plan --out`'s files, run.json (its commands as lifecycle.start records them)
    printed = show.plan_files(c, plan, device_ips=None, root=True)
    assert sh.MASK in printed["commands.json"]
    run = create_run(c, plan.to_dict(), cwd=tmp_path)
    cfgs = supervisor.configs(c, plan, run.id, launchers.build(c, plan, run.id, root={}))
    run.data["commands"] = show.recorded_commands(cfgs)
    run.save()
    for text in [*printed.values(), (run.dir / "run.json").read_text()]:
        assert not [v for v in secrets if v in text]
    assert "--token=***" in json.loads((run.dir / "run.json").read_text())["commands"]["h1"][0]["command"]

    # executed: what the supervisors are started with holds every secret the launch uses
    started = "".join(supervisor.boot(cfg).conf.decode() for cfg in cfgs.values())
    assert all(v in started for v in secrets)
    used = {v for cfg in cfgs.values() for p in cfg["procs"] for v in [*p["argv"], *p["env"].values()]}
    assert all(isinstance(v, sh.Secret) for v in used if any(s in v for s in secrets))
