"""job.collect after a real local run, then `orch collect` again: only what changed moves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
ORCH = [sys.executable, "-m", "orchestrator.cli"]
TRAIN = ("import os\n"
         "r = os.environ['RANK_ID']\n"
         "os.makedirs('ckpt/sub', exist_ok=True)\n"
         "open('ckpt/rank%s.bin' % r, 'wb').write(os.urandom(300000))\n"
         "open('ckpt/sub/meta%s.txt' % r, 'w').write('rank %s' % r)\n")


def test_outputs_come_back_after_the_run_and_again_only_when_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wd = tmp_path / "wd"
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "cluster.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 2}]}\n"
        f"job: {{workdir: {wd}, launcher: ranktable, command: [{PY}, {tmp_path}/train.py],\n"
        "      collect: ['ckpt/*.bin', 'ckpt/sub', 'nothing/*']}\n")
    up = subprocess.run(ORCH + ["up", "--skip-checks"], capture_output=True, text=True, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    run_dir = next((tmp_path / ".orch" / "runs").iterdir())
    got = run_dir / "collect" / "127.0.0.1"
    for r in (0, 1):
        assert (got / "ckpt" / f"rank{r}.bin").read_bytes() == (wd / "ckpt" / f"rank{r}.bin").read_bytes()
        assert (got / "ckpt" / "sub" / f"meta{r}.txt").read_text() == f"rank {r}"
    again = subprocess.run(ORCH + ["collect"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 file(s) fetched (0 bytes), 4 already here" in again.stdout, again.stdout
    (wd / "ckpt" / "rank1.bin").write_bytes(b"changed")
    os.symlink("/etc/hostname", wd / "ckpt" / "outside.bin")          # a link out of the workdir
    third = subprocess.run(ORCH + ["collect"], capture_output=True, text=True, timeout=120)
    assert "1 file(s) fetched (7 bytes), 3 already here" in third.stdout, third.stdout
    assert "ckpt/outside.bin: it resolves outside the workdir" in third.stdout
    assert (got / "ckpt" / "rank1.bin").read_bytes() == b"changed" and not (got / "ckpt" / "outside.bin").exists()
    bad = subprocess.run(ORCH + ["collect", "../x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "inside the workdir" in bad.stderr and "Traceback" not in bad.stderr
