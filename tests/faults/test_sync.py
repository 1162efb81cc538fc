"""Code sync over ssh on lab hosts: an interrupted sync never leaves a partial file under a real
name, and the hosts mirror the project (content, modes, links) without ever copying what a
link outside the project points to."""

from __future__ import annotations

import os

import pytest

from tests.support import interrupted_big_sync, orch, remote_ls, write_fault_cluster

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def sy(fx_lab):
    return fx_lab("y", 2)


def test_an_interrupted_sync_keeps_the_old_file_and_no_partial_one(sy, tmp_path):
    """Ctrl-C while a 300 MB file is on its way: every host keeps the previous, complete
    big.bin (never a prefix of the new one under its name), and no partial temp file stays."""
    interrupted_big_sync(sy, tmp_path, "/data/fx-sync-int", 1, (1, 2))


def test_hosts_mirror_modes_and_links_and_nothing_outside_the_project(sy, tmp_path):
    wd = "/data/fx-sync-mirror"
    proj = tmp_path / "proj"
    (proj / "lib").mkdir(parents=True)
    (proj / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(proj / "run.sh", 0o644)
    (proj / "lib" / "m.py").write_text("x = 1\n")
    os.symlink("lib/m.py", proj / "m.py")
    os.symlink("lib", proj / "pkg")
    (proj / ".git").mkdir()
    (proj / ".git" / "HEAD").write_text("ref\n")
    write_fault_cluster(sy, tmp_path, workdir=wd, launcher="ranktable", sync=["proj"],
                        command=["sh", "-c", "./proj/run.sh"], checks={"versions": ["python"]})
    res = orch("up", "-q", cwd=tmp_path, check_rc=1)  # not executable on the hosts either
    assert "Permission denied" in res.stderr.decode()
    os.chmod(proj / "run.sh", 0o755)  # a permission-only change reaches every host
    res = orch("up", cwd=tmp_path, check_rc=0)
    assert "synced: 2 file copies, 6 already up to date" in res.stderr.decode(), res.stderr.decode()  # 1 + 3 a host
    for i in (1, 2):
        out = sy.exec(i, ["sh", "-c", f"cd {wd}/proj && readlink m.py pkg && ls -a && stat -c %a run.sh"]).stdout
        assert out.split() == ["lib/m.py", "lib", ".", "..", "lib", "m.py", "pkg", "run.sh", "755"], out
    # a link out of the project: refused by the preflight and by the sync itself, nothing copied
    os.symlink("/etc/shadow", proj / "secret")
    res = orch("up", "-q", cwd=tmp_path, check_rc=3)
    assert "secret is a link to /etc/shadow, outside the synced directory" in res.stdout.decode() + res.stderr.decode()
    res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=2)
    assert "job.sync[0]" in res.stderr.decode() and "secret is a link to /etc/shadow" in res.stderr.decode()
    assert remote_ls(sy, 1, f"{wd}/proj/secret") == []
    os.unlink(proj / "secret")
    write_fault_cluster(sy, tmp_path, workdir=wd, launcher="ranktable", sync=["../../../../../../etc/shadow"],
                        command="true")
    res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=2)
    assert "leaves the cluster file's directory" in res.stderr.decode()
    assert remote_ls(sy, 1, f"{wd}/shadow") == []
