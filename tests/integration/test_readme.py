"""The README's set-up, walked as a newcomer would on a fresh clone: `bash scripts/demo.sh`
(a venv in the clone, orch installed there, the local demo), then `orch logs`, then a lab
made and used from that venv: once with the clone under /tmp (which every lab host mounts
its own of, so the venv's python is out of the hosts' sight) and once elsewhere.

pip installs from the package index (its cache is the real user's, so a warm cache makes this
quick); the lab needs root like every lab test.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lab


def _clone(dest: Path) -> None:
    if (REPO / ".git").exists():
        subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    else:  # not a git checkout: the tree as it is, without what a clone would not have
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".venv", ".orch", "__pycache__", "*.egg-info"))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "ORCH_VENV")}
    env["PIP_CACHE_DIR"] = os.path.join(pwd.getpwuid(os.getuid()).pw_dir, ".cache", "pip")
    return env


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["/tmp", "/var/tmp"])
def test_the_readme_set_up_works_on_a_fresh_clone(lab_factory, where):
    from tests.conftest import _name

    lab_name = _name("r")[:7] + ("t" if where == "/tmp" else "v")
    dest = Path(tempfile.mkdtemp(prefix="orch-readme-", dir=where)) / "orch"
    try:
        _clone(dest)
        env = _env()
        demo = subprocess.run(["bash", "scripts/demo.sh", "-q"], cwd=dest, env=env, capture_output=True, text=True,
                              timeout=600)
        assert demo.returncode == 0, (demo.stdout[-3000:], demo.stderr[-3000:])
        assert "succeeded: all 4 ranks exited 0" in demo.stderr, demo.stderr[-3000:]
        orch = str(dest / ".venv" / "bin" / "orch")
        logs = subprocess.run([orch, "logs", "--rank", "3"], cwd=dest, env=env, capture_output=True, text=True,
                              timeout=60)
        assert logs.returncode == 0 and "loss is" in logs.stdout, (logs.stdout[-2000:], logs.stderr)

        # the lab, from that venv (a clone under /tmp: its venv is out of the hosts' sight)
        up = subprocess.run([orch, "lab", "up", "2", "--name", lab_name], cwd=dest, env=env, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, (up.stdout, up.stderr)
        inv = subprocess.run([orch, "lab", "inventory", "--name", lab_name], cwd=dest, env=env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
        (dest / "hello.yaml").write_text("name: hello\ninventory: unused.yaml\n"
                                         "job: {workdir: /data/readme, command: [hostname], launcher: mpirun}\n")
        run = subprocess.run([orch, "up", "-q", "hello.yaml", "-i", inv], cwd=dest, env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, (run.stdout, run.stderr)
        names = {subprocess.run([orch, "logs", "--rank", str(r)], cwd=dest, env=env, capture_output=True, text=True,
                                timeout=60).stdout.strip() for r in range(4)}
        assert names == {f"{lab_name}-h1", f"{lab_name}-h2"}, names
    finally:
        if (dest / ".venv" / "bin" / "orch").exists():
            subprocess.run([str(dest / ".venv" / "bin" / "orch"), "lab", "down", "--name", lab_name],
                           capture_output=True, timeout=300)
        shutil.rmtree(dest.parent, ignore_errors=True)
