"""Scenario 11: secret environment values never land anywhere but the ranks' environment."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support import leftovers, orch, run_record, spawn_orch, wait_until

pytestmark = pytest.mark.lab

TAG = uuid.uuid4().hex[:12]
SECRETS = {  # name -> value; each is secret by name pattern or by job.secret_env
    "HF_TOKEN": f"tok-{TAG}-hf",
    "AWS_SECRET_ACCESS_KEY": f"key-{TAG}-aws",
    "DB_PASSWORD": f"pw-{TAG}-db",
    "MY_CRED": f"cred-{TAG}-mine",           # listed in job.secret_env
    "HOST_API_KEY": f"hostkey-{TAG}-h",      # from the inventory (host env)
    "SSH_DEPLOY_KEY": f"-----BEGIN KEY-----\nline-{TAG}-1\nline-{TAG}-2\n-----END KEY-----\n",
    "PIN_PASSWORD": "7" + TAG.translate(str.maketrans("abcdef", "123456"))[:9],  # a YAML number
    "ESC_TOKEN": f"esc-{TAG}-A",             # written with a YAML escape: \x41 for A
}
PLAIN = f"plain-{TAG}"

RANK_PY = """\
import hashlib, json, os, time
names = os.environ["FX_NAMES"].split()
print(json.dumps({n: hashlib.sha256(os.environ.get(n, "").encode()).hexdigest() for n in names}), flush=True)
print("plain", os.environ.get("FX_PLAIN"), flush=True)
time.sleep(float(os.environ.get("FX_SLEEP", "0")))
"""


def _cluster_text(lab, launcher: str, workdir: str) -> str:
    inv = yaml.safe_load(Path(lab.inventory_path).read_text())
    inv["hosts"] = inv["hosts"][:2]
    d = inv["defaults"]
    hosts = ", ".join(f"{{address: {h['address']}, name: {h['name']}}}" for h in inv["hosts"])
    block = "".join(f"      {ln}\n" for ln in SECRETS["SSH_DEPLOY_KEY"].splitlines())
    names = " ".join(SECRETS)
    return f"""\
inventory:
  defaults:
    user: {d['user']}
    identity_file: {d['identity_file']}
    known_hosts: {d['known_hosts']}
    slots: 2
    env: {{HOST_API_KEY: "{SECRETS['HOST_API_KEY']}"}}
  hosts: [{hosts}]
ssh: {{connect_timeout: 2, command_timeout: 30, retries: 2}}
job:
  launcher: {launcher}
  workdir: {workdir}
  command: python3 rank.py
  sync: [rank.py]
  secret_env: [MY_CRED]
  env:
    HF_TOKEN: {SECRETS['HF_TOKEN']}
    AWS_SECRET_ACCESS_KEY: '{SECRETS['AWS_SECRET_ACCESS_KEY']}'
    DB_PASSWORD: "{SECRETS['DB_PASSWORD']}"
    MY_CRED: {SECRETS['MY_CRED']}
    PIN_PASSWORD: {SECRETS['PIN_PASSWORD']}
    ESC_TOKEN: "{SECRETS['ESC_TOKEN'][:-1]}\\x41"
    SSH_DEPLOY_KEY: |
{block}    FX_PLAIN: {PLAIN}
    FX_NAMES: {names}
    FX_SLEEP: "2"
"""


def _forms() -> list[str]:
    """Every way a secret could show: its value, each line of a multi-line one, its YAML escape."""
    out = []
    for v in SECRETS.values():
        out += [v] + [ln for ln in v.splitlines() if TAG in ln]
    out.append(SECRETS["ESC_TOKEN"][:-1] + "\\x41")
    return out


def _leaks(data: bytes) -> list[str]:
    """The secret forms found in `data`; for JSON, in its decoded strings too (where an escaped
    backslash or newline would otherwise hide a value from a byte search)."""
    found = [f for f in _forms() if f.encode() in data]
    try:
        doc = json.loads(data)
    except ValueError:
        return found
    strings: list[str] = []

    def walk(x) -> None:
        if isinstance(x, str):
            strings.append(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return found + [f for f in _forms() for st in strings if f in st and f not in found]


def _cmdline_leaks() -> list[str]:
    """Processes on this machine (every lab host included) whose command line holds a secret."""
    forms = [f.encode() for f in _forms()]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(f in cmd for f in forms):
            found.append(f"{pid}: {cmd[:300]!r}")
    return found


@pytest.fixture(scope="module")
def slab(fx_lab):
    return fx_lab("k", 2)


@pytest.mark.parametrize("launcher", ["ranktable", "mpirun"])
def test_secrets_are_masked_everywhere_orch_writes(slab, tmp_path, launcher):
    """Scenario 11. Env vars that are secret (job.secret_env, or named *_TOKEN, *_KEY, *_SECRET,
    *PASSWORD*; in job.env or a host's env) reach the ranks intact but appear nowhere else:
    not in run.json (cluster_text and commands included), not in any file under the run
    directory, not in what `orch up`/`plan`/`status`/`logs`/`check` print, not in
    `orch plan --out` files, not in any process's command line on any host while the job
    runs (`ps` shows every user's command lines). run.json and the rendered files are not
    world-readable."""
    wd = f"/data/fx-secret-{launcher}"
    (tmp_path / "cluster.yaml").write_text(_cluster_text(slab, launcher, wd))
    (tmp_path / "rank.py").write_text(RANK_PY)
    outputs = []
    out_f, err_f = open(tmp_path / "up.out", "wb"), open(tmp_path / "up.err", "wb")
    proc = spawn_orch("up", cwd=tmp_path, stdout=out_f, stderr=err_f)
    ps_leaks = []
    try:
        assert wait_until(lambda: len(leftovers(_rid(tmp_path))) >= 4 if _rid(tmp_path) else False, 60)
        for _ in range(5):
            ps_leaks += _cmdline_leaks()
            time.sleep(0.1)
        rc = proc.wait(60)
    finally:
        proc.kill()
        out_f.close()
        err_f.close()
    outputs += [(tmp_path / "up.out").read_bytes(), (tmp_path / "up.err").read_bytes()]
    assert rc == 0, outputs
    assert ps_leaks == [], ps_leaks
    rec = run_record(tmp_path)
    run_dir = tmp_path / ".orch" / "runs" / rec["id"]
    want = {n: hashlib.sha256(v.encode()).hexdigest() for n, v in SECRETS.items()}
    for rank in range(4):  # delivered intact
        lines = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode().splitlines()
        assert json.loads(lines[0]) == want and lines[1] == f"plain {PLAIN}"
    assert PLAIN in rec["cluster_text"] and rec["job"]["env"]["FX_PLAIN"] == PLAIN  # masking is targeted
    commands = [["plan"], ["plan", "--json"], ["plan", "--out", tmp_path / "plan-out"], ["down"]]
    if launcher == "ranktable":  # the same whatever the launcher
        commands += [["status"], ["logs"], ["check"]]
    for args in commands:
        res = orch(*args, cwd=tmp_path)
        outputs += [res.stdout, res.stderr]
    for i, data in enumerate(outputs):
        assert _leaks(data) == [], (i, _leaks(data), data[-2000:])
    for path in [*run_dir.rglob("*"), *(tmp_path / "plan-out").rglob("*")]:
        if path.is_file() and "logs" not in path.relative_to(tmp_path).parts:
            assert _leaks(path.read_bytes()) == [], (path, _leaks(path.read_bytes()))
    assert stat.S_IMODE((run_dir / "run.json").stat().st_mode) & 0o077 == 0
    for path in run_dir.iterdir():
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    # on the hosts: only the ranks' own environment dump holds the values, and only its owner reads it
    for i in (1, 2):
        res = slab.exec(i, ["grep", "-rlF", SECRETS["HF_TOKEN"], wd])
        for f in res.stdout.split():
            assert f.endswith("/env.log"), f
            mode = slab.exec(i, ["stat", "-c", "%a", f]).stdout.strip()
            assert mode == "600", (f, mode)


def _rid(cwd: Path) -> str | None:
    try:
        return run_record(cwd)["id"]
    except (IndexError, OSError, ValueError, KeyError):
        return None


def test_secrets_stay_out_of_error_messages(slab, tmp_path):
    """Scenario 11 (errors). A failing job's report and a rejected cluster file never print
    a secret value."""
    wd = "/data/fx-secret-fail"
    text = _cluster_text(slab, "ranktable", wd).replace("command: python3 rank.py",
                                                        "command: [sh, -c, 'echo failing; exit 3']")
    (tmp_path / "cluster.yaml").write_text(text)
    (tmp_path / "rank.py").write_text(RANK_PY)
    res = orch("up", "-q", cwd=tmp_path, check_rc=1)
    assert _leaks(res.stdout + res.stderr) == []
    bad = text.replace(f"HF_TOKEN: {SECRETS['HF_TOKEN']}", f"HF_TOKEN: [{SECRETS['HF_TOKEN']}]")
    (tmp_path / "cluster.yaml").write_text(bad)
    res = orch("up", "-q", cwd=tmp_path, check_rc=2)
    assert b"HF_TOKEN" in res.stderr and _leaks(res.stdout + res.stderr) == [], res.stderr
