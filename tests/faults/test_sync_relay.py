"""Code sync through the launch host (job.sync_via: launch-host) on lab hosts: the tree arrives
identical on every host, a change is passed on, a launch-host copy that is not what it listed is
caught and sent again, and a hop that fails names itself."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.support import interrupted_big_sync, orch, write_fault_cluster

pytestmark = pytest.mark.lab

WD = "/data/fx-relay"


@pytest.fixture(scope="module")
def rl(fx_lab):
    return fx_lab("l", 3)  # test_lifecycle's lab: three plain hosts


def local_sums(root: Path) -> dict[str, str]:
    return {p.relative_to(root.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def host_sums(lab, i: int) -> dict[str, str]:
    out = lab.exec(i, ["sh", "-c", f"cd {WD} && find proj -type f -exec sha256sum {{}} + | sort -k2"]).stdout
    return {rel: sha for sha, rel in (line.split() for line in out.splitlines())}


def test_the_launch_host_passes_the_tree_on_checked_at_every_hop(rl, tmp_path):
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    for i in range(20):
        (proj / "pkg" / f"m{i}.py").write_text(f"x = {i}\n" * 200)
    (proj / "big.bin").write_bytes(os.urandom(2 << 20))
    for i in (1, 2, 3):
        rl.exec(i, ["rm", "-rf", WD])
    write_fault_cluster(rl, tmp_path, workdir=WD, launcher="ranktable", sync_via="launch-host", sync=["proj"],
                        command="true")
    res = orch("up", "--skip-checks", cwd=tmp_path, check_rc=0)
    err = res.stderr.decode()
    assert "passed on by" in err and "synced: 63 file copies, 0 already up to date" in err, err
    want = local_sums(proj)
    for i in (1, 2, 3):
        assert host_sums(rl, i) == want, i

    # a change is passed on: one file, to every host
    (proj / "pkg" / "m3.py").write_text("changed\n")
    res = orch("up", "--skip-checks", cwd=tmp_path, check_rc=0)
    assert "synced: 3 file copies, 60 already up to date" in res.stderr.decode(), res.stderr.decode()
    want = local_sums(proj)
    for i in (1, 2, 3):
        assert host_sums(rl, i) == want, i

    # the launch host's copy damaged with its size and mtime kept (the quick check cannot see
    # it), and the others lack the file: caught before it is passed on, sent to it again
    rl.exec(1, ["sh", "-c", f"cd {WD}/proj && touch -r big.bin ../big.ref && "
                            "dd if=/dev/zero of=big.bin bs=1k count=1 conv=notrunc 2>/dev/null && "
                            "touch -r ../big.ref big.bin && rm ../big.ref"])
    for i in (2, 3):
        rl.exec(i, ["rm", "-f", f"{WD}/proj/big.bin"])
    res = orch("up", "--skip-checks", cwd=tmp_path, check_rc=0)
    assert "the launch host's copy of 1 file(s) was not what it listed, sent again: proj/big.bin" in \
        res.stderr.decode(), res.stderr.decode()
    for i in (1, 2, 3):
        assert host_sums(rl, i) == want, i

    # a hop that fails names itself: a link planted on host 3 where the relay must write a directory
    rl.exec(3, ["sh", "-c", f"rm -rf {WD}/proj/pkg && ln -s /tmp {WD}/proj/pkg"])
    res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=1)
    err = res.stderr.decode()
    assert " -> " in err and "(job.sync_via: launch-host): cannot write" in err and \
        "is a symbolic link, not a directory orch made" in err, err
    rl.exec(3, ["rm", "-f", f"{WD}/proj/pkg"])


def test_an_interrupted_relay_leaves_no_partial_file_on_any_host(rl, tmp_path):
    """Ctrl-C while a big file is on its way to the launch host and passed on from it: every
    host keeps a complete big.bin (the old one or the new one, never a prefix) and no temp file."""
    interrupted_big_sync(rl, tmp_path, "/data/fx-relay-int", 3, (1, 2, 3), sync_via="launch-host")
