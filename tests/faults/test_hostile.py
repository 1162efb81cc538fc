"""Scenario 8: hostile strings reach the rank byte-for-byte and execute nothing."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support import leftovers, orch, run_record

pytestmark = pytest.mark.lab

TAG = uuid.uuid4().hex[:10]
MARK = f"/tmp/fx-pwned-{TAG}"


def hostile(i: int, newline: bool = True) -> str:
    """One string with every character a shell could act on, and a marker file it would create."""
    s = (f"it's a \"q\" $(touch {MARK}-{i}a) `touch {MARK}-{i}b` ; touch {MARK}-{i}c & touch {MARK}-{i}d "
         f"| touch {MARK}-{i}e && x || y back\\slash \\\\ \\n $HOME ${{PATH}} * ~ -n  two  spaces\ttab "
         "ünïcødé ✓ 日本")
    return s + ("\nsecond line\n" if newline else "")


ARGS = ["-n", hostile(1), "", "*", "$(touch %s-arg)" % MARK, "a\\b", "new\nline", " lead", "trail ", "ü"]
FILES = [f"it's $(touch fx-pwned-{TAG}-f1) `touch fx-pwned-{TAG}-f2` ;&| \\ ü.txt", "new\nline.txt", "-n", "*",
         " sp ", "a\\nb"]

HOSTILE_WORKDIR = f"/data/fx %s it's \"q\" $(touch {MARK}-w1) `touch {MARK}-w2` ; & | \\ $HOME * ü 日本"
HOSTILE_LOG_DIR = f"logs $(touch {MARK}-l1) `touch {MARK}-l2` ;&| \\ ü"
MPIRUN_WORKDIR = f"/data/fx mpirun it's 'q' ; touch {MARK}-w3 & touch {MARK}-w4 | (x) <y> * ~ ü 日本"
MPIRUN_LOG_DIR = f"logs ; touch {MARK}-l3 &| 'q' ü"

RANK_PY = """\
import json, os, sys
payload = os.path.join(os.getcwd(), "payload")
files = {n: open(os.path.join(payload, n), "rb").read().decode() for n in sorted(os.listdir(payload))}
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                  "env": {k: os.environ.get(k) for k in ("FX_JOB", "FX_HOST", "FX_PLAIN")},
                  "files": files}), flush=True)
"""


@pytest.fixture(scope="module")
def hlab(fx_lab):
    return fx_lab("h", 2)


def _cluster(lab, tmp_path: Path, launcher: str) -> tuple[Path, dict]:
    inv = yaml.safe_load(Path(lab.inventory_path).read_text())
    # (no '/' in a host name: names become file names; the markers are relative paths instead)
    names = [f"h1 {hostile(2, newline=False)}".replace(f"{MARK}-", f"fx-pwned-{TAG}-"),
             f"h2 b`touch fx-pwned-{TAG}-n2`;&|\\ $(touch fx-pwned-{TAG}-n3) 'q' ü"]
    inv["hosts"] = [{"address": lab.host(i + 1).address, "name": names[i]} for i in range(2)]
    inv["hosts"][1]["env"] = {"FX_HOST": hostile(3)}
    inv["defaults"]["env"] = {"FX_HOST": hostile(3)}
    # each path component stays under NAME_MAX (255 bytes); the slashes in MARK make subdirectories
    workdir, log_dir = HOSTILE_WORKDIR % launcher, HOSTILE_LOG_DIR
    if launcher == "mpirun":  # $ ` " \ ! are refused for mpirun (see the test below)
        workdir, log_dir = MPIRUN_WORKDIR, MPIRUN_LOG_DIR
    doc = {
        "inventory": inv,
        "ssh": {"connect_timeout": 2, "command_timeout": 30, "retries": 2},
        "job": {"launcher": launcher, "workdir": workdir, "log_dir": log_dir,
                "command": ["python3", "rank.py", *ARGS], "sync": ["rank.py", "payload"],
                "env": {"FX_JOB": hostile(6), "FX_PLAIN": "plain"}},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    (tmp_path / "rank.py").write_text(RANK_PY)
    payload = tmp_path / "payload"
    payload.mkdir(exist_ok=True)
    for i, name in enumerate(FILES):
        (payload / name).write_text(f"file {i}: {hostile(7 + i)}")
    expected = {"argv": ARGS, "cwd": workdir, "env": {"FX_JOB": hostile(6), "FX_HOST": hostile(3), "FX_PLAIN": "plain"},
                "files": {n: f"file {i}: {hostile(7 + i)}" for i, n in enumerate(FILES)}}
    return path, {"names": names, "expected": expected}


def _markers(paths) -> list[str]:
    """The marker files among `paths`: exactly fx-pwned-TAG-<id> (the hostile workdir's own path
    components contain that text too, followed by more characters)."""
    return [p for p in paths if re.fullmatch(rf"fx-pwned-{TAG}-\w+", os.path.basename(p))]


def _no_marker(lab, tmp_path: Path) -> None:
    here = _markers(str(p) for d in (Path("/tmp"), tmp_path, Path.cwd()) for p in d.rglob(f"fx-pwned-{TAG}*"))
    assert here == [], f"a hostile string was executed on this machine: {here}"
    for i in (1, 2):
        found = lab.exec(i, ["find", "/tmp", "/data", "/root", "-name", f"fx-pwned-{TAG}*", "-print0"]).stdout
        assert _markers(found.split("\0")) == [], f"a hostile string was executed on {lab.host(i).name}: {found}"


@pytest.mark.parametrize("launcher", ["ranktable", "mpirun"])
def test_hostile_strings_reach_the_rank_verbatim_and_run_nothing(hlab, tmp_path, launcher):
    """Scenario 8. Host names, env values (job and host), command arguments, synced file names
    and contents, workdir and log_dir holding quotes, $(), backticks, ; & |, backslashes,
    newlines (where YAML allows), spaces and non-ASCII reach every rank byte-for-byte
    (the rank prints what it got as JSON), appear verbatim in `orch status`, and execute
    nothing anywhere (no marker file on this machine or any host); a second `orch up`, on the
    host picked by its hostile name with --hosts, finds every synced file up to date."""
    _, info = _cluster(hlab, tmp_path, launcher)
    orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    rec = run_record(tmp_path)
    assert [h["name"] for h in rec["hosts"]] == info["names"]
    assert json.loads(orch("logs", "--rank", 3, cwd=tmp_path, check_rc=0).stdout) == info["expected"]
    lines = orch("logs", cwd=tmp_path, check_rc=0).stdout.decode().splitlines()  # JSON: one line a rank
    assert [ln.split(" ", 2)[:2] for ln in lines] == [["[rank", f"{r}]"] for r in range(4)], lines
    for ln in lines:
        assert json.loads(ln.split(" ", 2)[2]) == info["expected"], ln
    st = json.loads(orch("status", "--json", cwd=tmp_path, check_rc=0).stdout)
    assert [r["host"] for r in st["ranks"]] == [info["names"][0]] * 2 + [info["names"][1]] * 2
    # the same again: every file is found up to date on every host, whatever its name
    res = orch("up", "--skip-checks", "--hosts", info["names"][1], cwd=tmp_path, check_rc=0)
    assert f"0 file copies, {len(FILES) + 1} already up to date" in res.stderr.decode(), res.stderr.decode()
    assert leftovers(run_record(tmp_path)["id"]) == []
    _no_marker(hlab, tmp_path)


def test_hostile_strings_in_check_and_plan_run_nothing(hlab, tmp_path):
    """Scenario 8 (preflight and plan). `orch check` and `orch plan` on the same hostile
    cluster file execute nothing anywhere, whatever they conclude."""
    _cluster(hlab, tmp_path, "mpirun")
    res = orch("check", "--json", cwd=tmp_path)
    assert res.returncode in (0, 1), res.stderr.decode()
    json.loads(res.stdout)
    orch("plan", "--out", tmp_path / "plan-out", cwd=tmp_path, check_rc=0)
    _no_marker(hlab, tmp_path)


@pytest.mark.parametrize("key,value", [("workdir", HOSTILE_WORKDIR % "mpirun"), ("log_dir", HOSTILE_LOG_DIR)])
def test_mpirun_refuses_paths_its_remote_shell_would_expand(hlab, tmp_path, key, value):
    """Scenario 8 (mpirun). mpirun passes its output directory to the other hosts' shell inside
    double quotes, where $ ` " \\ ! would be expanded: orch refuses such a workdir/log_dir
    for the mpirun launcher before touching any host (exit 2, naming the field and its line)."""
    path, _ = _cluster(hlab, tmp_path, "mpirun")
    doc = yaml.safe_load(path.read_text())
    doc["job"][key] = value
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    for cmd in (["up", "-q", "--skip-checks"], ["plan"], ["check"]):
        err = orch(*cmd, cwd=tmp_path, check_rc=2).stderr.decode()
        assert f"job.{key}" in err and "double quotes" in err and "launcher: ranktable" in err, err
    assert not (tmp_path / ".orch").exists()
    _no_marker(hlab, tmp_path)
